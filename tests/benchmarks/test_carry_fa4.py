"""benchmarks/carry_fa4.py on synthetic wheels (no download needed): the parts it cuts reassemble to the same
bytes, arriving one per device call in any order (the earlier calls' parts found in the stash), a corrupted part is
refused or passed over, and the unpacked folder imports as ``pip install --target`` would lay it out."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import carry_fa4

BLOB = random.Random(0).randbytes(
    300_000
)  # incompressible: the archive stays ~300 KB, three parts of 0.1 MiB


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(
        folder / "pkg_a-1.0-py3-none-any.whl",
        {
            "pkg_a/__init__.py": b"VALUE = 41\n",
            "pkg_a/blob.bin": BLOB,
            "pkg_a-1.0.dist-info/METADATA": b"Name: pkg_a\nVersion: 1.0\n",
            "pkg_a-1.0.data/purelib/pkg_a_extra.py": b"EXTRA = 1\n",  # installed at the top, as pip does
            "pkg_a-1.0.data/scripts/tool": b"#!/bin/sh\n",  # not needed to import: left out
        },
    )
    _wheel(
        folder / "libs-1.0-py3-none-any.whl",
        {
            f"{carry_fa4.EXTRA_PATH}/inner_mod.py": b"INNER = 2\n",
            "libs-1.0.dist-info/METADATA": b"Name: libs\n",
        },
    )
    return folder


def _device_call(device: Path, prepared: Path, part: str, site: Path) -> int:
    """One device call: the repository copy carries only ``part`` (an earlier call's carried folder is gone)."""
    carried = device / ".whl"
    shutil.rmtree(carried, ignore_errors=True)
    carried.mkdir(parents=True)
    shutil.copytree(prepared / part, carried / part)
    stashes = [device / ".fa4_stash", device / "tmp_stash"]
    return carry_fa4.install(carried, stashes, site, probe=None)


def test_parts_arrive_one_call_each_in_any_order_and_install(wheels: Path, tmp_path: Path) -> None:
    prepared = tmp_path / "here" / ".whl"
    folders = carry_fa4.prepare(wheels, prepared, part_mib=0.1, use_python=True)
    assert [f.name for f in folders] == ["fa4_part1", "fa4_part2", "fa4_part3"]
    manifest = json.loads((folders[0] / carry_fa4.MANIFEST).read_text())
    sizes = [part["bytes"] for part in manifest["parts"]]
    assert max(sizes) <= 0.1 * carry_fa4.MiB and max(sizes) - min(sizes) <= manifest["bytes"] // 3
    assert sum(sizes) == manifest["bytes"]
    assert all(json.loads((f / carry_fa4.MANIFEST).read_text()) == manifest for f in folders)

    device, site = tmp_path / "device", tmp_path / "device" / "site"
    # a site holding another package already (flash-attn 2 built there): kept beside the unpacked files
    (site / "pkg_a").mkdir(parents=True)
    (site / "pkg_a" / "built_here.py").write_text("KEPT = True\n")
    assert _device_call(device, prepared, "fa4_part3", site) == carry_fa4.INCOMPLETE
    assert _device_call(device, prepared, "fa4_part1", site) == carry_fa4.INCOMPLETE
    assert not (site / "pkg_a" / "blob.bin").exists()
    assert _device_call(device, prepared, "fa4_part2", site) == 0
    assert (site / "pkg_a" / "blob.bin").read_bytes() == BLOB
    assert (site / "pkg_a" / "built_here.py").read_text() == "KEPT = True\n"
    assert (site / "pkg_a_extra.py").is_file() and not (site / "tool").exists()
    assert json.loads((site / ".installed.json").read_text())["sha256"] == manifest["sha256"]

    # a later call finds it installed (the marker's checksum), and the printed path imports both folders
    assert _device_call(device, prepared, "fa4_part1", site) == 0
    path = carry_fa4.python_path(site)
    assert path.split(":") == [str(site), str(site / carry_fa4.EXTRA_PATH)]
    probe = "import pkg_a, pkg_a_extra, inner_mod; print(pkg_a.VALUE + inner_mod.INNER)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={"PYTHONPATH": path}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "43"


def test_a_corrupted_part_is_refused_when_carried_and_passed_over_when_stashed(
    wheels: Path, tmp_path: Path
) -> None:
    prepared = tmp_path / "here" / ".whl"
    carry_fa4.prepare(wheels, prepared, part_mib=0.2, use_python=True)
    device, site = tmp_path / "device", tmp_path / "device" / ".fa4_site"
    assert _device_call(device, prepared, "fa4_part1", site) == carry_fa4.INCOMPLETE
    stashed = device / ".fa4_stash" / "fa4.tar.xz.1"
    data = bytearray(stashed.read_bytes())
    data[1000] ^= 0xFF
    stashed.write_bytes(bytes(data))  # the other stash keeps a good copy: the install still completes
    assert _device_call(device, prepared, "fa4_part2", site) == 0

    bad = prepared / "fa4_part2" / "fa4.tar.xz.2"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="SHA-256"):
        _device_call(tmp_path / "device2", prepared, "fa4_part2", tmp_path / "device2" / ".fa4_site")


def test_two_wheels_writing_one_file_are_refused(wheels: Path, tmp_path: Path) -> None:
    _wheel(wheels / "pkg_a-2.0-py3-none-any.whl", {"pkg_a/__init__.py": b"VALUE = 2\n"})
    with pytest.raises(SystemExit, match="keep one version"):
        carry_fa4.prepare(wheels, tmp_path / ".whl", part_mib=1, use_python=True)


def test_the_cuda_12_libraries_are_refused(wheels: Path, tmp_path: Path) -> None:
    _wheel(
        wheels / "nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        {"x/cu12.so": b""},
    )
    with pytest.raises(SystemExit, match="is not needed"):
        carry_fa4.prepare(wheels, tmp_path / ".whl", part_mib=1, use_python=True)
