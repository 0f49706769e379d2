"""``LoadHFWeights`` takes a local Hugging Face model folder and refuses anything else where it is built: before
``Trainer(devices=N)`` starts its processes (which build it again, each with the same answer) and before any
process group, with the callback, the path and the fix in the message. Only names are looked at: the files here
are empty."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_d9d.callbacks import LoadHFWeights


def model_folder(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def test_a_model_folder_is_taken_single_file_or_sharded(tmp_path: Path) -> None:
    single = model_folder(tmp_path / "single", "config.json", "model.safetensors")
    sharded = model_folder(
        tmp_path / "sharded",
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )
    assert LoadHFWeights(single).path == single
    assert LoadHFWeights(str(sharded)).path == sharded
    # check_config=False reads no config.json, so none is needed
    assert LoadHFWeights(model_folder(tmp_path / "bare", "model.safetensors"), check_config=False)


def test_a_hub_id_is_refused_with_the_download_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        LoadHFWeights("Qwen/Qwen3-0.6B")
    message = str(caught.value)
    assert message.startswith("LoadHFWeights('Qwen/Qwen3-0.6B'): no local folder Qwen/Qwen3-0.6B")
    assert "never downloads" in message
    assert "`hf download Qwen/Qwen3-0.6B --local-dir qwen3-0.6b`" in message
    assert "LoadHFWeights('qwen3-0.6b')" in message
    # the same name as a folder that exists is a local folder, not a Hub id
    model_folder(tmp_path / "Qwen" / "Qwen3-0.6B", "config.json", "model.safetensors")
    assert LoadHFWeights("Qwen/Qwen3-0.6B").path == Path("Qwen/Qwen3-0.6B")


def test_a_missing_folder_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "qwen3"
    with pytest.raises(FileNotFoundError, match=re.escape(f"the folder {missing} does not exist")) as caught:
        LoadHFWeights(missing)
    assert str(caught.value).startswith(f"LoadHFWeights({str(missing)!r})")
    assert "never downloads: `hf download" in str(caught.value)


def test_a_file_is_refused_naming_its_folder(tmp_path: Path) -> None:
    folder = model_folder(tmp_path / "qwen3", "config.json", "model.safetensors")
    with pytest.raises(NotADirectoryError, match=re.escape(f"the folder holding it is {str(folder)!r}")):
        LoadHFWeights(folder / "model.safetensors")


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (
            ("model.safetensors", "tokenizer.json"),
            "has no config.json, so it is not a Hugging Face model folder",
        ),
        (("config.json", "pytorch_model.bin"), "holds no safetensors weights (model.safetensors, or"),
        (("config.json", "model.safetensors.index.json.part"), "holds no safetensors weights"),
        (
            ("meta.pt", ".metadata", "__0_0.distcp"),
            "is a training checkpoint, not a Hugging Face model folder",
        ),
        (("adapter_config.json", "adapter_model.safetensors"), "is a peft adapter (adapter_config.json)"),
    ],
    ids=["no_config", "bin_weights", "no_weights", "training_checkpoint", "peft_adapter"],
)
def test_a_folder_that_is_not_a_model_is_refused_saying_what_it_is(
    tmp_path: Path, names: tuple[str, ...], expected: str
) -> None:
    folder = model_folder(tmp_path / "folder", *names)
    with pytest.raises(FileNotFoundError, match=re.escape(expected)) as caught:
        LoadHFWeights(folder)
    assert str(caught.value).startswith(f"LoadHFWeights({str(folder)!r})")
    if "no config.json" in expected:
        assert "it holds model.safetensors, tokenizer.json" in str(caught.value)
    if expected.startswith("is a training checkpoint"):
        assert f"ckpt_path={str(folder)!r}" in str(caught.value)
