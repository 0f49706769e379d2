"""``python -m lightning_d9d.convert``: dcp-to-hf and hf-to-hf, called through ``main(argv)`` in this process
(the same code path as the command line, without 10 s of ``import lightning`` per call)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hf_helpers import SMALL, batch, config_json, hf_logits, load_transformers, make_hf_checkpoint
from state_helpers import read_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "hf"))
from tiny_hf import tiny_causal_lm, tiny_config

from lightning_d9d.convert import build_parser, main
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from lightning_d9d.models.hf import add_selection_bias
from lightning_d9d.state import INDEX_NAME, manifest
from lightning_d9d.state.training import read_dcp_metadata, save
from lightning_d9d.strategies.hf_record import with_hf_config


def test_help_lists_the_commands_and_says_why_there_is_no_hf_to_dcp() -> None:
    text = build_parser().format_help()
    for expected in (
        "dcp-to-hf",
        "hf-to-hf",
        "There is no hf-to-dcp",
        "LoadHFWeights",
        "qwen3 (Qwen3ForCausalLM)",
    ):
        assert expected in text, expected
    for command in ("dcp-to-hf", "hf-to-hf"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0


def test_hf_to_hf_reshards_casts_and_copies_the_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    code = main(
        [
            "hf-to-hf",
            str(tmp_path / "hf"),
            str(tmp_path / "out"),
            "--dtype",
            "bf16",
            "--max-shard-size",
            "20KB",
        ]
    )
    assert code == 0
    stats_free = capsys.readouterr().out
    assert "hf-to-hf:" in stats_free and "tensors" in stats_free
    out = tmp_path / "out"
    names = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", INDEX_NAME} <= set(names)
    assert sum(name.endswith(".safetensors") for name in names) > 1
    assert config_json(out)["dtype"] == "bfloat16" and config_json(out)["model_type"] == "qwen3"
    written = read_checkpoint(out)
    for key, value in hf.state_dict().items():
        if key != "lm_head.weight" or key in written:
            assert written[key].dtype == torch.bfloat16 and torch.equal(
                written[key], value.to(torch.bfloat16)
            ), key
    back = load_transformers(out)
    assert back.dtype == torch.bfloat16


def _write_training_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    prefix: str = "model.",
    meta: dict[str, Any] | None = None,
    with_manifest: bool = True,
) -> None:
    """What the strategy writes, in the small, without a process group: DCP of {"state_dict": LightningModule
    keys (both names of a tied head), "optimizer_0": ...}, then ``meta.pt`` (``meta``) and ``manifest.json``
    through the strategy's own save. ``with_manifest=False``: the DCP files alone, as a tool other than the
    strategy writes them."""
    import torch.distributed.checkpoint as dcp

    state = {prefix + key: value for key, value in model.state_dict().items()}
    optimizer = {f"state.{key}.exp_avg": torch.zeros_like(value) for key, value in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if with_manifest:
            save(
                directory, {"state_dict": state, "optimizer_states": [optimizer], "epoch": 0, **(meta or {})}
            )
        else:
            dcp.save(
                {"state_dict": state, "optimizer_0": optimizer}, checkpoint_id=str(directory), no_dist=True
            )


@pytest.mark.parametrize("tied", [False, True])
def test_dcp_to_hf(tied: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf", tie_word_embeddings=tied)
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(config_json(tmp_path / "hf")))
    ours.load_state_dict(hf.state_dict())
    _write_training_checkpoint(tmp_path / "ckpt", ours)

    argv = ["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--config", str(tmp_path / "hf")]
    assert main([*argv, "--stats"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["tensors"] == len(hf.state_dict()) - tied and stats["peak_rss_bytes"] > 0
    written = read_checkpoint(tmp_path / "out")
    assert ("lm_head.weight" in written) is not tied
    for key, value in written.items():
        assert torch.equal(value, hf.state_dict()[key]), key
    assert (tmp_path / "out" / "tokenizer.json").is_file()  # --config as a directory brings its tokenizer
    ids = batch(int(SMALL["vocab_size"]))
    torch.testing.assert_close(hf_logits(load_transformers(tmp_path / "out"), ids), hf_logits(hf, ids))


def test_dcp_to_hf_finds_the_config_recorded_by_the_callbacks(tmp_path: Path) -> None:
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    _write_training_checkpoint(tmp_path / "ckpt", ours, prefix="net.")
    out = tmp_path / "out"
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out)]) == 1  # no config anywhere yet
    recorded = {"callbacks": {"LoadHFWeights{'path': 'x'}": {"hf_config": ours.config.to_hf_dict()}}}
    _write_training_checkpoint(tmp_path / "ckpt", ours, prefix="net.", meta=recorded)  # replaces it
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--dtype", "bfloat16"]) == 0  # prefix "net."
    written = read_checkpoint(out)
    assert torch.equal(written["model.norm.weight"], ours.model.norm.weight.detach().to(torch.bfloat16))
    assert config_json(out)["hidden_size"] == SMALL["hidden_size"] and config_json(out)["dtype"] == "bfloat16"


def test_dcp_to_hf_errors_name_the_checkpoint_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    _write_training_checkpoint(tmp_path / "ckpt", ours)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")

    # a config of another size than the checkpoint: named by key, from the DCP metadata alone
    (tmp_path / "wider.json").write_text(json.dumps({**ours.config.to_hf_dict(), "intermediate_size": 64}))
    assert main(["dcp-to-hf", ckpt, out, "--config", str(tmp_path / "wider.json")]) == 1
    error = capsys.readouterr().err
    assert (
        "'model.layers.0.mlp.up_proj.weight'" in error
        and "'model.model.layers.0.mlp.up_proj.weight'" in error
    )
    assert str(tmp_path / "ckpt") in error and "(48, 32), the config implies (64, 32)" in error

    # more layers in the config than in the checkpoint
    (tmp_path / "deeper.json").write_text(json.dumps({**ours.config.to_hf_dict(), "num_hidden_layers": 3}))
    assert main(["dcp-to-hf", ckpt, out, "--config", str(tmp_path / "deeper.json")]) == 1
    error = capsys.readouterr().err
    assert (
        "num_hidden_layers (3) is more than the 2 layers" in error and str(tmp_path / "deeper.json") in error
    )
    assert "('model.model.layers.0' to 'model.model.layers.1')" in error

    # a prefix that holds nothing
    assert main(["dcp-to-hf", ckpt, out, "--config", str(tmp_path / "wider.json"), "--prefix", "net."]) == 1
    assert "missing from checkpoint" in capsys.readouterr().err

    # not a checkpoint at all
    assert main(["dcp-to-hf", str(tmp_path), out, "--config", str(tmp_path / "wider.json")]) == 1
    assert "is not a torch.distributed.checkpoint directory" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dcp_to_hf_with_a_damaged_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    _write_training_checkpoint(tmp_path / "ckpt", ours)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ours.config.to_hf_dict()))
    argv = ["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--config", str(config)]
    (data,) = (tmp_path / "ckpt").glob("*.distcp")
    content = data.read_bytes()
    data.write_bytes(content[: len(content) // 5])  # truncated inside the model tensors
    assert main(argv) == 1  # found from the sizes in manifest.json, before anything else is read
    error = capsys.readouterr().err
    assert f"{data} has {len(content) // 5} bytes, but" in error and manifest.MANIFEST_NAME in error
    # without the manifest's checks (--no-verify), the reader's own checks still name file and key:
    argv.append("--no-verify")
    assert main(argv) == 1  # found from the sizes in .metadata, before reading
    error = capsys.readouterr().err
    # a key of the model (which tensors lie past the cut depends on the order DCP laid them out in the file)
    assert f"{data} is truncated" in error and "but 'model." in error and "is stored up to byte" in error
    cut = len(content) // 5
    data.write_bytes(bytes(cut) + content[cut:])  # the model tensors zeroed out: same size, unreadable
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert f"{data}: cannot read 'model." in error  # the model's key DCP laid out first in the file
    data.unlink()  # missing
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert f"in {data}, which does not exist" in error and "'model." in error  # as above: any of its keys
    (tmp_path / "ckpt" / ".metadata").write_bytes(b"not a pickle")
    assert main(argv) == 1
    assert ".metadata cannot be read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _flip_a_bit_in_a_model_tensor(checkpoint: Path) -> Path:
    """Flip one bit in the middle of the largest model tensor's bytes (same size: only a checksum tells); the
    .distcp file it lies in."""
    storage = read_dcp_metadata(checkpoint).storage_data
    info = max(
        (info for index, info in storage.items() if index.fqn.startswith("state_dict.")),
        key=lambda info: info.length,
    )
    file = checkpoint / info.relative_path
    content = bytearray(file.read_bytes())
    content[info.offset + info.length // 2] ^= 0x04
    file.write_bytes(bytes(content))
    return file


def test_dcp_to_hf_verifies_the_manifest_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    _write_training_checkpoint(tmp_path / "ckpt", ours)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ours.config.to_hf_dict()))
    out = tmp_path / "out"
    argv = ["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--config", str(config)]
    shard = _flip_a_bit_in_a_model_tensor(tmp_path / "ckpt")
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert f"error: {shard} is damaged: the CRC-32 of its bytes" in error
    assert str(tmp_path / "ckpt" / manifest.MANIFEST_NAME) in error
    assert not out.exists()
    # what the check prevents: unverified, the damage converts without an error into a changed tensor
    assert main([*argv, "--no-verify"]) == 0
    written = read_checkpoint(out)
    reference = {key: value for key, value in ours.state_dict().items() if key in written}
    assert any(not torch.equal(written[key], value) for key, value in reference.items())


def test_dcp_to_hf_refuses_a_checkpoint_without_manifest_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    _write_training_checkpoint(tmp_path / "ckpt", ours, with_manifest=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(ours.config.to_hf_dict()))
    out = tmp_path / "out"
    argv = ["dcp-to-hf", str(tmp_path / "ckpt"), str(out), "--config", str(config)]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert f"{tmp_path / 'ckpt'} has no {manifest.MANIFEST_NAME}, so its files cannot be verified" in error
    assert (
        "something other than D9DStrategy" in error and "did not finish" in error and "--no-verify" in error
    )
    assert not out.exists()
    assert main([*argv, "--no-verify"]) == 0
    written = read_checkpoint(out)
    for key, value in written.items():
        assert torch.equal(value, ours.state_dict()[key]), key


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_dcp_to_hf_converts_a_transformers_model_s_checkpoint(family: str, tmp_path: Path) -> None:
    """A transformers model trained under the strategy keeps its class's names and layout (Llama: no format of
    ours; Qwen3-MoE: fused experts, not our stacked ones): its training checkpoint records the class's config and
    converts without --config into files from_pretrained loads, the selection bias our adapter added left out."""
    model = tiny_causal_lm(family)
    if family == "qwen3_moe":
        add_selection_bias(model)
    holder = torch.nn.Module()
    holder.model = model  # as a LightningModule holds it: keys under "model."
    checkpoint = with_hf_config({}, holder)
    assert checkpoint["hf_config"]["architectures"] == [type(model).__name__]
    _write_training_checkpoint(tmp_path / "ckpt", model, meta=checkpoint)
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    loaded = type(model).from_pretrained(tmp_path / "out")
    ids = batch(int(model.config.vocab_size))
    torch.testing.assert_close(hf_logits(loaded, ids), hf_logits(model, ids), rtol=1e-5, atol=1e-5)
    assert not [key for key in read_checkpoint(tmp_path / "out") if "expert_bias" in key]


def test_the_class_a_config_names_must_be_a_transformers_model() -> None:
    """``architectures`` is read from a file: only a transformers model class is built from it."""
    from lightning_d9d.state.errors import CheckpointError
    from lightning_d9d.state.hf import transformers_model_format

    for name in ("AutoTokenizer", "Trainer", "no_such_class"):
        with pytest.raises(CheckpointError, match="name no transformers model class"):
            transformers_model_format({"model_type": "llama", "architectures": [name]})


# ------------------------------------------------------------------------------- untrusted configs and paths
def _transformers_checkpoint(directory: Path, **recorded: Any) -> torch.nn.Module:
    """A tiny transformers Llama's training checkpoint, its recorded config changed by ``recorded`` (as a
    crafted ``meta.pt`` would hold it); returns the model."""
    model = tiny_causal_lm("llama")
    holder = torch.nn.Module()
    holder.model = model
    checkpoint = with_hf_config({}, holder)
    checkpoint["hf_config"].update(recorded)
    _write_training_checkpoint(directory, model, meta=checkpoint)
    return model


def _llama_config_file(path: Path, **overrides: Any) -> Path:
    content = {**tiny_config("llama", **overrides).to_dict(), "architectures": ["LlamaForCausalLM"]}
    path.write_text(json.dumps(content))
    return path


# Fields with which transformers fetches or imports code: a Hub kernel for attention (downloaded and imported by
# the kernels package), remote modelling code, a quantizer.
CODE_FIELDS: dict[str, Any] = {
    "attn_implementation": "kernels-community/flash-attn2@0123456789abcdef0123456789abcdef01234567",
    "_attn_implementation_internal": "org/attention@main",
    "experts_implementation": "org/experts",
    "auto_map": {"AutoModelForCausalLM": "org/repo--modeling.CausalLM"},
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_a_recorded_config_fetches_no_code_and_is_exported_without_those_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers.integrations import hub_kernels

    fetched: list[tuple[Any, ...]] = []

    def get_kernel(*args: Any, **kwargs: Any) -> None:
        fetched.append(args)
        raise AssertionError(f"a Hub kernel was fetched: {args}")

    monkeypatch.setattr(hub_kernels, "get_kernel", get_kernel)
    model = _transformers_checkpoint(tmp_path / "ckpt", **CODE_FIELDS)
    out = tmp_path / "out"
    code = main(["dcp-to-hf", str(tmp_path / "ckpt"), str(out)])
    assert fetched == [] and code == 0
    assert "left out of config.json" in capsys.readouterr().out
    written = config_json(out)
    assert not set(CODE_FIELDS) & set(written)
    assert written["architectures"] == ["LlamaForCausalLM"]
    ids = batch(int(model.config.vocab_size))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(hf_logits(loaded, ids), hf_logits(model, ids), rtol=1e-5, atol=1e-5)


def test_a_config_transformers_cannot_build_is_a_clean_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _transformers_checkpoint(tmp_path / "ckpt", hidden_act="no_such_activation", num_attention_heads=0)
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: transformers cannot build LlamaForCausalLM from the config recorded in")
    assert "Traceback" not in error and not (tmp_path / "out").exists()


def test_save_hf_writes_no_code_fields_into_config_json(tmp_path: Path) -> None:
    from lightning_d9d.state.hf import save_hf

    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    config = {**ours.config.to_hf_dict(), **CODE_FIELDS, "text_config": {"attn_implementation": "org/repo"}}
    save_hf(ours, tmp_path / "export", config)
    written = config_json(tmp_path / "export")
    assert not set(CODE_FIELDS) & set(written) and written["text_config"] == {}
    assert written["hidden_size"] == SMALL["hidden_size"]


def test_the_transformers_fallback_checks_shapes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A family without a format of ours (Llama) is checked against its class built on meta: a config of
    another width is refused naming the key and both shapes, before anything is written."""
    _transformers_checkpoint(tmp_path / "ckpt")  # hidden size 64
    narrow = _llama_config_file(tmp_path / "narrow.json", hidden_size=32, head_dim=8)
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--config", str(narrow)]) == 1
    error = capsys.readouterr().err
    assert "'lm_head.weight'" in error and "'model.lm_head.weight'" in error
    assert "shape (128, 64), the config implies (128, 32)" in error and str(narrow) in error
    assert not (tmp_path / "out").exists()


def test_the_transformers_fallback_refuses_layers_the_config_does_not_have(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _transformers_checkpoint(tmp_path / "ckpt")  # 2 layers
    shallow = _llama_config_file(tmp_path / "shallow.json", layers=1)
    assert main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--config", str(shallow)]) == 1
    error = capsys.readouterr().err
    assert "tensors of layers the config does not have" in error and str(shallow) in error
    assert "'model.layers.1.input_layernorm.weight'" in error
    assert not (tmp_path / "out").exists()


def test_a_layer_count_beyond_the_checkpoint_is_refused_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import lightning_d9d.convert as convert

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("built from a layer count the checkpoint does not hold")

    monkeypatch.setattr(transformers.AutoConfig, "for_model", never)  # the transformers fallback
    monkeypatch.setattr(convert, "writing_mapper", never)  # our formats' per-layer mappers
    _transformers_checkpoint(tmp_path / "llama", num_hidden_layers=4000)
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(SMALL))
    recorded = {"hf_config": {**ours.config.to_hf_dict(), "num_hidden_layers": 4000}}
    _write_training_checkpoint(tmp_path / "qwen3", ours, meta=recorded)
    for checkpoint in ("llama", "qwen3"):
        assert main(["dcp-to-hf", str(tmp_path / checkpoint), str(tmp_path / "out")]) == 1
        error = capsys.readouterr().err
        assert "num_hidden_layers (4000) is more than the 2 layers" in error, error
        assert "'model.model.layers.0' to 'model.model.layers.1'" in error
    # a handed Hugging Face directory: its config.json against its own files
    make_hf_checkpoint(tmp_path / "hf")
    config = config_json(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4000}))
    assert main(["hf-to-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "num_hidden_layers (4000) is more than the 2 layers" in error
    assert str(tmp_path / "hf" / "config.json") in error
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    assert main(["hf-to-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 1
    assert "num_hidden_layers must be a non-negative integer, not '2'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_expert_count_beyond_the_checkpoint_is_refused_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crafted expert count would have the per-expert mappers make millions of entries (85 s for three million,
    unbounded memory for more) before any shape is compared: refused from the files' names and shapes first, for a
    handed Hugging Face folder (one tensor per expert, or stacked) and a training checkpoint's recorded config."""
    from test_hf_qwen3_moe import SMALL as MOE
    from test_hf_qwen3_moe import make_moe_checkpoint

    import lightning_d9d.convert as convert

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("built from an expert count the checkpoint does not hold")

    monkeypatch.setattr(convert, "writing_mapper", never)
    monkeypatch.setattr(convert, "reading_mapper", never)
    for layout, fused in (("one tensor per expert", False), ("stacked", True)):
        folder = tmp_path / f"hf-{fused}"
        make_moe_checkpoint(folder, fused=fused)
        config = config_json(folder)
        (folder / "config.json").write_text(json.dumps({**config, "num_experts": 3_000_000}))
        assert main(["hf-to-hf", str(folder), str(tmp_path / "out")]) == 1, layout
        error = capsys.readouterr().err
        assert f"num_experts (3000000) is more than the {MOE['num_experts']} experts {folder} holds" in error
        (folder / "config.json").write_text(json.dumps({**config, "num_experts": "6"}))
        assert main(["hf-to-hf", str(folder), str(tmp_path / "out")]) == 1, layout
        assert "num_experts must be a non-negative integer, not '6'" in capsys.readouterr().err
    ours = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_hf_dict(MOE))  # stacked experts in the checkpoint
    recorded = {"hf_config": {**ours.config.to_hf_dict(), "num_experts": 3_000_000}}
    _write_training_checkpoint(tmp_path / "qwen3_moe", ours, meta=recorded)
    assert main(["dcp-to-hf", str(tmp_path / "qwen3_moe"), str(tmp_path / "out")]) == 1
    assert "num_experts (3000000) is more than the 6 experts checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dcp_to_hf_never_writes_into_the_directory_of_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hf = make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "model-q4.gguf").write_bytes(b"GGUF")  # a file the export would not carry
    ours = Qwen3ForCausalLM(Qwen3Config.from_hf_dict(config_json(tmp_path / "hf")))
    ours.load_state_dict(hf.state_dict())
    _write_training_checkpoint(tmp_path / "ckpt", ours)
    ckpt, config = str(tmp_path / "ckpt"), tmp_path / "hf"
    for output, given, where in [
        (config, config, "is inside"),  # the directory itself
        (tmp_path / "ckpt" / ".." / "hf", config, "is inside"),  # the same, spelt otherwise
        (config / "export", config, "is inside"),  # inside it
        (config, config / "config.json", "is"),  # the directory of a config file
    ]:
        assert main(["dcp-to-hf", ckpt, str(output), "--config", str(given)]) == 1
        error = capsys.readouterr().err
        assert f"the output {output} {where} {config.resolve()}, the directory --config" in error
    assert (config / "model-q4.gguf").read_bytes() == b"GGUF" and not (config / "export").exists()
    # in a directory of its own beside a config file (or inside that file's directory) is fine
    config_file = str(config / "config.json")
    assert main(["dcp-to-hf", ckpt, str(tmp_path / "hf" / "sub"), "--config", config_file]) == 0


def test_hf_to_hf_refuses_an_output_inside_its_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_hf_checkpoint(tmp_path / "hf")
    for output in (tmp_path / "hf" / ".", tmp_path / "hf" / "copy"):
        assert main(["hf-to-hf", str(tmp_path / "hf"), str(output)]) == 1
        assert f"the output {output} is inside {(tmp_path / 'hf').resolve()}" in capsys.readouterr().err
    assert not (tmp_path / "hf" / "copy").exists()


def test_linked_side_files_are_not_copied(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A handed directory whose tokenizer links to a private file: the link is skipped, and a log line says so."""
    make_hf_checkpoint(tmp_path / "hf")
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    (tmp_path / "hf" / "tokenizer.json").symlink_to(secret)
    (tmp_path / "hf" / "vocab.txt").write_text("a b c")
    (tmp_path / "hf" / "merges.txt").symlink_to(tmp_path / "hf" / "vocab.txt")  # a link, even inside
    with caplog.at_level("WARNING", logger="lightning_d9d.state.hf.io"):
        assert main(["hf-to-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    names = {path.name for path in (tmp_path / "out").iterdir()}
    assert "vocab.txt" in names and not {"tokenizer.json", "merges.txt"} & names
    assert "BEGIN PRIVATE KEY" not in "".join(
        p.read_text(errors="ignore") for p in (tmp_path / "out").iterdir()
    )
    logged = caplog.text
    assert "tokenizer.json" in logged and "merges.txt" in logged and "symbolic link" in logged


def test_code_and_oversized_side_files_are_not_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A handed folder's remote modelling code stays behind, and so does a side file too large to read whole."""
    from lightning_d9d.state.hf import io

    monkeypatch.setattr(io, "MAX_SIDE_FILE_BYTES", 64)
    make_hf_checkpoint(tmp_path / "hf")
    (tmp_path / "hf" / "modeling_custom.py").write_text("import os; os.system('echo hi')")
    (tmp_path / "hf" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "hf" / "huge.txt").write_text("x" * 65)
    with caplog.at_level("WARNING", logger="lightning_d9d.state.hf.io"):
        assert main(["hf-to-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    names = {path.name for path in (tmp_path / "out").iterdir()}
    assert "tokenizer_config.json" in names and not {"modeling_custom.py", "huge.txt"} & names
    assert "modeling_custom.py is code" in caplog.text and "huge.txt holds 65 bytes" in caplog.text
