"""``examples/finetune_hf.py`` start to finish, as its docstring runs it: a tiny Qwen3 folder with a tokenizer and
chat data; LoRA on 2 CPU processes (FSDP over both); the same command resumed on one process; the merged export
loaded by ``transformers``, the adapter by ``peft`` onto the base folder, both giving the same logits; generation
from the export through the chat template."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import peft
import torch
import transformers

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def finetune(tmp_path: Path, *args: str) -> str:
    command = [sys.executable, str(EXAMPLE), "--model", "tiny/model", "--data", "tiny/chat.jsonl"]
    command += [
        "--output",
        "run",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--accelerator",
        "cpu",
    ]
    proc = subprocess.run(
        [*command, *args], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def losses(stdout: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+) loss ([\d.]+)$", stdout, re.M)}


def test_the_recipe_fine_tunes_resumes_exports_and_serves(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("finetune_hf", EXAMPLE)
    assert spec is not None and spec.loader is not None
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.make_tiny(tmp_path / "tiny")

    first = losses(finetune(tmp_path, "--devices", "2", "--max-steps", "20", "--save-every", "10"))
    assert set(first) == {2, 4, 6, 8, 10, 12, 14, 16, 18, 20}
    assert first[20] < first[2] - 0.5  # it learns the sums
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    # the same command, 10 steps more, on one process: it resumes from last.ckpt (step 20), on another layout
    resumed = losses(finetune(tmp_path, "--devices", "1", "--max-steps", "30", "--save-every", "10"))
    assert min(resumed) > 20 and resumed[30] < first[2] - 0.5

    export = tmp_path / "run" / "export" / "final"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert json.loads((export / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ] == ("tiny/model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)  # copied from the model folder
    merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny" / "model").eval()
    messages = [{"role": "user", "content": "what is two plus three"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        base_logits = base(**prompt).logits
        adapted = peft.PeftModel.from_pretrained(base, str(export / "adapter")).eval()
        merged_logits, peft_logits = merged(**prompt).logits, adapted(**prompt).logits
    assert (merged_logits - base_logits).abs().max() > 1e-1  # fine-tuning changed the model
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-5, rtol=0)
    answer = merged.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert answer.shape[1] == prompt["input_ids"].shape[1] + 3
    assert tokenizer.decode(answer[0, -3:]).split()  # words of the tiny vocabulary
