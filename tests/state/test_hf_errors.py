"""Each way a Hugging Face checkpoint can be wrong for our model, through ``load_hf`` and the command line: the
error names the file and the key (or the config field)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # noqa: F401 (a test dependency: a broken install must fail, not skip)
from hf_helpers import SMALL, config_json, make_hf_checkpoint
from safetensors.torch import load_file, save_file

from lightning_d9d.convert import main as convert_main
from lightning_d9d.models import Qwen3Config, Qwen3ForCausalLM
from lightning_d9d.state import (
    INDEX_NAME,
    CheckpointFileError,
    ConfigMismatchError,
    CorruptShardError,
    KeyCoverageError,
    MissingShardError,
    ShapeMismatchError,
)
from lightning_d9d.state.hf import load_hf

KEY = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    make_hf_checkpoint(tmp_path / "hf")
    # Re-shard into several files with an index, the usual layout of real checkpoints.
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "model.safetensors").unlink()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {key: names[position % 2] for position, key in enumerate(sorted(state))}
    for name in names:
        save_file({k: v for k, v in state.items() if weight_map[k] == name}, str(tmp_path / "hf" / name))
    (tmp_path / "hf" / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path / "hf"


def model(**overrides: Any) -> Qwen3ForCausalLM:
    values = {k: v for k, v in SMALL.items()}
    return Qwen3ForCausalLM(Qwen3Config.from_hf_dict({**values, **overrides}))


def shard_of(directory: Path, key: str) -> str:
    return str(json.loads((directory / INDEX_NAME).read_text())["weight_map"][key])


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert convert_main(list(argv)) == 1
    return capsys.readouterr().err


def test_the_fixture_loads(hf_dir: Path) -> None:
    # The errors below come from breaking this fixture: unbroken, every tensor of its shards lands in the model.
    shards = set(json.loads((hf_dir / INDEX_NAME).read_text())["weight_map"].values())
    expected = {key: value for shard in shards for key, value in load_file(str(hf_dir / shard)).items()}
    loaded = model()
    load_hf(loaded, hf_dir)
    state = loaded.state_dict()
    assert state.keys() == expected.keys()
    for key, tensor in expected.items():
        assert torch.equal(state[key], tensor), f"{key} differs from the fixture's {shard_of(hf_dir, key)}"


def test_missing_shard_file(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = shard_of(hf_dir, KEY)
    (hf_dir / shard).unlink()
    with pytest.raises(MissingShardError) as raised:
        load_hf(model(), hf_dir)
    assert shard in str(raised.value) and "model.layers" in str(raised.value)
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))
    assert shard in error and INDEX_NAME in error
    assert not (tmp_path / "out").exists()


def test_missing_config(hf_dir: Path) -> None:
    (hf_dir / "config.json").unlink()
    with pytest.raises(CheckpointFileError, match=r"hf/config\.json does not exist"):
        load_hf(model(), hf_dir)
    load_hf(model(), hf_dir, check_config=False)  # the weights alone are fine


def test_truncated_shard(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = shard_of(hf_dir, KEY)
    data = (hf_dir / shard).read_bytes()
    (hf_dir / shard).write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptShardError) as raised:
        load_hf(model(), hf_dir)
    assert shard in str(raised.value) and "truncated" in str(raised.value)
    assert "'model." in str(raised.value)  # names keys the file should hold
    assert shard in cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))


def test_key_missing_from_the_index(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    index = json.loads((hf_dir / INDEX_NAME).read_text())
    del index["weight_map"][KEY]
    (hf_dir / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(KeyCoverageError) as raised:
        load_hf(model(), hf_dir)
    assert raised.value.missing_source == [KEY]
    assert repr(KEY) in str(raised.value) and INDEX_NAME in str(raised.value)
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))
    assert repr(KEY) in error and INDEX_NAME in error


def test_shape_mismatch(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tensor whose shape disagrees with config.json (a corrupted or hand-edited checkpoint)."""
    shard = shard_of(hf_dir, KEY)
    state = load_file(str(hf_dir / shard))
    state[KEY] = state[KEY][:-1]  # one row short
    save_file(state, str(hf_dir / shard))
    with pytest.raises(ShapeMismatchError) as raised:
        load_hf(model(), hf_dir)
    assert raised.value.key == KEY
    message = str(raised.value)
    assert "expects shape (48, 32)" in message and "gives (47, 32)" in message and shard in message
    # The command line finds it in the headers, before reading any tensor.
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))
    assert repr(KEY) in error and shard in error and "(47, 32)" in error and "(48, 32)" in error


@pytest.mark.parametrize(
    ("field", "file_value", "module_value"),
    [("hidden_size", 32, 64), ("num_hidden_layers", 2, 3), ("tie_word_embeddings", False, True)],
)
def test_checkpoint_of_a_qwen3_of_another_size(
    hf_dir: Path, field: str, file_value: Any, module_value: Any
) -> None:
    overrides: dict[str, Any] = {field: module_value}
    if field == "hidden_size":
        overrides["head_dim"] = SMALL["head_dim"]
    with pytest.raises(ConfigMismatchError) as raised:
        load_hf(model(**overrides), hf_dir)
    message = str(raised.value)
    assert "another model" in message and str(hf_dir / "config.json") in message
    assert f"{field} is {file_value!r} there but {module_value!r}" in message
    assert raised.value.fields == {field: (file_value, module_value)}


def test_checkpoint_of_another_model_type(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = config_json(hf_dir)
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigMismatchError) as raised:
        load_hf(model(), hf_dir)
    message = str(raised.value)
    assert "another model" in message and "'llama'" in message and "'qwen3'" in message
    assert str(hf_dir / "config.json") in message
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))
    assert "no Hugging Face mapping for model_type 'llama'" in error and "qwen3" in error


def test_command_line_refuses_another_model_and_a_config_that_does_not_fit(
    hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --model names what the user expects
    config = config_json(hf_dir)
    config["model_type"] = "qwen3"
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"), "--model", "qwen3_moe")
    assert "describes another model: model_type 'qwen3', not 'qwen3_moe' (--model)" in error
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"), "--model", "llama")
    assert "no Hugging Face mapping for model_type 'llama'" in error
    # a config.json of another size than the weights beside it: named by key and file, from the headers
    config["intermediate_size"] = 64
    (hf_dir / "config.json").write_text(json.dumps(config))
    error = cli_error(capsys, "hf-to-hf", str(hf_dir), str(tmp_path / "out"))
    assert "a checkpoint of another model?" in error and "'model.layers.0.mlp.down_proj.weight'" in error
    assert "model-0000" in error and "(32, 48), the config implies (32, 64)" in error
    assert not (tmp_path / "out").exists()
