"""Fine-tune a Hugging Face model folder on chat data, with LoRA or in full, on one or N devices; export it for
``transformers`` and ``peft``.

    python examples/finetune_hf.py --make-tiny runs/tiny     # a tiny Qwen3 folder (model/) and chat data (chat.jsonl)
    python examples/finetune_hf.py --model runs/tiny/model --data runs/tiny/chat.jsonl --output runs/ft --devices 2
    python examples/finetune_hf.py --model runs/tiny/model --data runs/tiny/chat.jsonl --output runs/ft-full --full

What it does:

- ``FineTune`` is a LightningModule around ``AutoModelForCausalLM`` built from the folder's ``config.json`` on the
  meta device; ``LoadHFWeights`` fills it from the folder's weights once the strategy has sharded it.
- Conversations (one JSON list of ``{"role", "content"}`` messages per line) become ``Document``s whose loss
  mask marks the assistant's turns only (``chat_documents``, from the tokenizer's chat template), packed into
  rows of ``--seq-len`` tokens; a conversation is never cut across rows.
- ``D9DStrategy(lora=LoRA(rank=...))`` adapts every projection of the decoder layers and freezes the rest
  (``--full`` trains everything); the optimizer gets the trainable parameters; the learning rate warms up
  linearly, then follows a cosine to 10 %.
- ``ModelCheckpoint`` saves every ``--save-every`` steps (``last.ckpt`` too): rerun the same command to resume.
- ``ExportHF`` writes ``<output>/export/final``: the merged weights (``transformers`` loads them as they are), with
  LoRA also the ``peft`` adapter in ``<output>/export/final/adapter`` (``PeftModel.from_pretrained``), and the
  tokenizer files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_d9d import D9DStrategy, LoRA, model_loss
from lightning_d9d.callbacks import ExportHF, LoadHFWeights
from lightning_d9d.data import PackedDataset, chat_documents
from lightning_d9d.modules.loss import causal_lm_loss


class FineTune(L.LightningModule):
    """A ``transformers`` causal LM from ``model_dir`` (built on meta: its weights come from ``LoadHFWeights``)."""

    def __init__(
        self, model_dir: str, lr: float = 2e-4, warmup_steps: int = 10, max_steps: int = 100
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        import transformers

        if self.model is None:
            config = transformers.AutoConfig.from_pretrained(self.hparams["model_dir"])  # a local folder
            with torch.device("meta"):
                self.model = transformers.AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}  # documents restart
        loss = model_loss(self, self.model, inputs, batch["labels"], causal_lm_loss)
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        trainable = [p for p in self.parameters() if p.requires_grad]  # with LoRA: the adapters alone
        optimizer = torch.optim.AdamW(trainable, lr=self.hparams["lr"], weight_decay=0.0)
        warmup, total = self.hparams["warmup_steps"], self.hparams["max_steps"]

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PrintLoss(Callback):
    """Rank 0 prints the step's loss every ``every`` optimizer steps (the run has no logger)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step % self.every == 0 or step == trainer.max_steps):
            print(f"step {step} loss {float(outputs['loss']):.4f}", flush=True)


def read_conversations(path: Path) -> list[list[dict[str, str]]]:
    """One conversation per line: a JSON list of messages."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--make-tiny", type=Path, help="write a tiny Qwen3 folder (DIR/model) and chat data")
    parser.add_argument("--model", type=Path, help="a Hugging Face model folder (config, weights, tokenizer)")
    parser.add_argument("--data", type=Path, help="conversations, one JSON list of messages per line")
    parser.add_argument("--output", type=Path, default=Path("runs/finetune"))
    parser.add_argument("--full", action="store_true", help="train every weight instead of LoRA adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-alpha", type=float, default=32.0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on GPUs, 32-true elsewhere")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per device")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=50)
    args = parser.parse_args(argv)
    if args.make_tiny is not None:
        make_tiny(args.make_tiny)
        return
    if args.model is None or args.data is None:
        parser.error("--model and --data are required (or --make-tiny DIR)")

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)  # a local folder's tokenizer
    documents = list(chat_documents(read_conversations(args.data), tokenizer))
    rows = PackedDataset(documents, seq_len=args.seq_len)
    gpu = torch.cuda.is_available() and args.accelerator in ("auto", "gpu", "cuda")
    lora = None if args.full else LoRA(rank=args.lora_rank, alpha=args.lora_alpha)
    trainer = L.Trainer(
        strategy=D9DStrategy(lora=lora),
        accelerator=args.accelerator,
        devices=args.devices,
        precision=args.precision or ("bf16-mixed" if gpu else "32-true"),
        max_steps=args.max_steps,
        logger=False,
        default_root_dir=args.output,
        callbacks=[
            LoadHFWeights(args.model),
            ModelCheckpoint(
                dirpath=args.output / "checkpoints", every_n_train_steps=args.save_every, save_last=True
            ),
            ExportHF(
                args.output / "export", filename="final", copy_files_from=args.model, base_model=args.model
            ),
            PrintLoss(every=max(1, args.max_steps // 10)),
        ],
    )
    module = FineTune(str(args.model), lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps)
    last = args.output / "checkpoints" / "last.ckpt"
    trainer.fit(
        module,
        DataLoader(rows, batch_size=args.batch_size, shuffle=True),
        ckpt_path=str(last) if last.exists() else None,  # the same command resumes
    )
    if trainer.is_global_zero:
        print(f"done: {dict((k, float(v)) for k, v in trainer.callback_metrics.items())}")
        print(f"exported: {args.output / 'export' / 'final'}")


# ------------------------------------------------------------------------------------ a tiny model folder
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATE = (  # ChatML, the assistant's turns inside generation markers (what the loss mask learns)
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>\n' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def tiny_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Questions about sums of two digits and their answers, one or two turns each."""
    generator = torch.Generator().manual_seed(seed)
    conversations = []
    for _ in range(count):
        messages = [{"role": "system", "content": "answer in words"}]
        for _ in range(int(torch.randint(1, 3, (1,), generator=generator))):
            a, b = (int(x) for x in torch.randint(0, 5, (2,), generator=generator))
            messages.append({"role": "user", "content": f"what is {NUMBERS[a]} plus {NUMBERS[b]}"})
            messages.append({"role": "assistant", "content": f"it is {NUMBERS[a + b]}"})
        conversations.append(messages)
    return conversations


def make_tiny(directory: Path) -> None:
    """A tiny Qwen3 (random weights) with a word-level tokenizer in ``directory/model``, saved as a Hugging Face
    folder is (what ``--model`` takes, without downloading anything), and chat data in ``directory/chat.jsonl``."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    conversations = tiny_conversations(256)
    words = sorted({w for c in conversations for m in c for w in (m["role"], *m["content"].split())})
    vocab = {word: number for number, word in enumerate(["[UNK]", "\n", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.Split(Regex("\n"), "isolated")]
    )
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = TEMPLATE
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    assert len(tokenizer) <= config.vocab_size, len(tokenizer)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    with open(directory / "chat.jsonl", "w") as lines:
        for conversation in conversations:
            lines.write(json.dumps(conversation) + "\n")
    print(f"wrote {directory}: a tiny Qwen3, its tokenizer and {len(conversations)} conversations")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
