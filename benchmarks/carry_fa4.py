"""FlashAttention 4 (``flash_attn.cute``) for a GPU host without a network: its wheels, unpacked and
recompressed here, travel in parts small enough for one device call each, and are put back together there.

    python benchmarks/carry_fa4.py prepare            # here: .whl/fa4/*.whl -> .whl/fa4_part1/, .whl/fa4_part2/, ...
    python3 benchmarks/carry_fa4.py install           # there, once per call: stash this call's part, and once every
                                                      # part is there, verify, unpack into .fa4_site/, import it
    export PYTHONPATH=$(python3 benchmarks/carry_fa4.py pythonpath):$PWD   # there, after the install

Why parts: the cu13 library wheel of nvidia-cutlass-dsl is 92 MB (a 193 MB compiler library inside); unpacked and
recompressed with xz it is still larger than one call carries beside the repository (64 MiB for the whole
working tree), so ``prepare`` splits one ``.tar.xz`` of every wheel's files into equal parts, each in its own
ignored folder with a manifest (every part's SHA-256 and the whole's). Each device call carries one part folder;
``install`` copies the part it finds into ``.fa4_stash/`` (ignored and not carried, so a machine still warm for
the next call keeps it) and into ``/tmp/fa4_stash/`` (the same machine's ``/tmp``, a second chance), and the call
that completes the set checks every part and the whole, unpacks with Python's own ``lzma`` (no ``xz`` or ``zstd``
needed there) and imports the package. Parts may arrive in any order. ``benchmarks/README.md`` has the calls.

The unpacked tree is what ``pip install --target`` would make of the wheels, except that the ``.pth`` file of
``nvidia-cutlass-dsl`` (which puts its ``dsl_packages`` folder on ``sys.path``) does nothing on ``PYTHONPATH``:
``pythonpath`` prints both folders. Only the standard library is used: the same file runs on both machines.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
NAME = "fa4"
ARCHIVE = f"{NAME}.tar.xz"
MANIFEST = "manifest.json"
#: A part's ceiling: the repository (~4 MiB) and the other carried wheels (.whl/ao18 3 MiB, .whl/titan 2 MiB)
#: travel beside it in 64 MiB.
PART_MIB = 40.0
#: Exit status of an ``install`` call that stashed its part and waits for the others.
INCOMPLETE = 3
#: The folder of nvidia-cutlass-dsl's own packages (its ``.pth`` file adds it to ``sys.path``).
EXTRA_PATH = "nvidia_cutlass_dsl/dsl_packages"
PROBE = (
    "import importlib.metadata as m, cutlass, flash_attn.cute as fa; "
    "print('flash-attn-4', m.version('flash-attn-4'), 'nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'), "
    "'at', fa.__file__); print('flash_attn_func:', fa.flash_attn_func.__module__)"
)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


def say(message: str) -> None:
    print(f"[carry_fa4] {message}", flush=True)


# ------------------------------------------------------------------------------------------------ here
def wheel_members(wheel: Path) -> Iterable[tuple[str, zipfile.ZipInfo]]:
    """``(path inside the install folder, entry)`` of each file of a wheel, as ``pip install --target`` lays
    them out: ``*.data/purelib`` and ``*.data/platlib`` go to the top; other ``*.data`` folders (scripts, headers)
    are not needed to import the package and are left out."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            yield "/".join(parts), info


def build_tar(wheels: list[Path], tar_path: Path) -> dict[str, int]:
    """One uncompressed tar of every wheel's files (sorted, fixed times: the same wheels give the same bytes).
    Returns ``{"files": n, "bytes": unpacked size}``; refuses two wheels that write the same file."""
    seen: dict[str, str] = {}
    files = total = 0
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                for name, info in sorted(wheel_members(wheel), key=lambda item: item[0]):
                    if name in seen:
                        raise SystemExit(f"{name} is in both {seen[name]} and {wheel.name}: keep one version")
                    seen[name] = wheel.name
                    data = archive.read(info)
                    entry = tarfile.TarInfo(name)
                    entry.size, entry.mtime = len(data), 0
                    mode = (info.external_attr >> 16) & 0o777
                    entry.mode = 0o755 if mode & 0o111 else 0o644
                    tar.addfile(entry, io.BytesIO(data))
                    files, total = files + 1, total + len(data)
    return {"files": files, "bytes": total}


def compress(tar_path: Path, out: Path) -> str:
    """xz at its strongest setting: the ``xz`` program on all cores where it exists (same format, faster), else
    Python's ``lzma``. Returns which one ran."""
    if shutil.which("xz"):
        with out.open("wb") as handle:
            subprocess.run(["xz", "-9e", "-T0", "-c", str(tar_path)], stdout=handle, check=True)
        return "xz -9e -T0"
    with tar_path.open("rb") as source, lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as target:
        shutil.copyfileobj(source, target, MiB)
    return "python lzma, preset 9e"


def split(archive: Path, out_root: Path, part_mib: float, extra: dict[str, object]) -> list[Path]:
    """``archive`` cut into the fewest equal parts of at most ``part_mib``: ``out_root/fa4_part<i>/`` holding
    ``fa4.tar.xz.<i>`` and the manifest (the same in every part)."""
    size = archive.stat().st_size
    limit = int(part_mib * MiB)
    count = max(1, -(-size // limit))
    step = -(-size // count)
    for stale in out_root.glob(f"{NAME}_part*"):
        shutil.rmtree(stale)
    folders, parts = [], []
    with archive.open("rb") as handle:
        for index in range(1, count + 1):
            folder = out_root / f"{NAME}_part{index}"
            folder.mkdir(parents=True)
            chunk = handle.read(step)
            part = folder / f"{ARCHIVE}.{index}"
            part.write_bytes(chunk)
            parts.append(
                {"name": part.name, "folder": folder.name, "bytes": len(chunk), "sha256": sha256(part)}
            )
            folders.append(folder)
    manifest = {"archive": ARCHIVE, "bytes": size, "sha256": sha256(archive), "parts": parts, **extra}
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return folders


def prepare(wheel_dir: Path, out_root: Path, part_mib: float, use_python: bool = False) -> list[Path]:
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"no wheels in {wheel_dir}: download them first (benchmarks/README.md, 'FlashAttention 4')"
        )
    # the DSL's CUDA 12 and 13 libraries write different files (no clash to catch below), each 92 MB: the
    # machine's torch is CUDA 13, so the CUDA 12 one would only double what travels
    cuda12 = [w.name for w in wheels if w.name.startswith("nvidia_cutlass_dsl_libs_cu12")]
    if cuda12:
        raise SystemExit(
            f"{cuda12[0]} is not needed (the GPU host's torch is CUDA 13): remove it from {wheel_dir}"
        )
    with tempfile.TemporaryDirectory() as scratch:
        tar_path, xz_path = Path(scratch) / f"{NAME}.tar", Path(scratch) / ARCHIVE
        stats = build_tar(wheels, tar_path)
        say(
            f"{len(wheels)} wheels, {stats['files']} files, {stats['bytes'] / MiB:.1f} MiB unpacked; compressing"
        )
        if use_python:
            with (
                tar_path.open("rb") as source,
                lzma.open(xz_path, "wb", preset=9 | lzma.PRESET_EXTREME) as target,
            ):
                shutil.copyfileobj(source, target, MiB)
            how = "python lzma, preset 9e"
        else:
            how = compress(tar_path, xz_path)
        extra = {"wheels": [w.name for w in wheels], "unpacked_bytes": stats["bytes"], "compressor": how}
        folders = split(xz_path, out_root, part_mib, extra)
        say(f"{xz_path.stat().st_size / MiB:.1f} MiB compressed ({how}) -> {len(folders)} part(s):")
    for folder in folders:
        say(f"  {folder}: {sum(p.stat().st_size for p in folder.iterdir()) / MiB:.1f} MiB")
    return folders


# ------------------------------------------------------------------------------------------------ there
def _manifests(carried: Path, stashes: list[Path]) -> list[dict]:
    found = []
    for folder in [*sorted(carried.glob(f"{NAME}_part*")), *stashes]:
        path = folder / MANIFEST
        if path.is_file():
            found.append(json.loads(path.read_text()))
    return found


def _locate(part: dict, carried: Path, stashes: list[Path]) -> Path | None:
    """The first copy of ``part`` whose checksum is right: the carried folder, then each stash."""
    for folder in [carried / part["folder"], *stashes]:
        path = folder / part["name"]
        if path.is_file() and path.stat().st_size == part["bytes"] and sha256(path) == part["sha256"]:
            return path
        if path.is_file():
            say(f"ignoring {path}: its size or SHA-256 is not the manifest's")
    return None


def stash(carried: Path, stashes: list[Path]) -> list[str]:
    """Copy each carried part (checked against its manifest) into every stash folder; returns their names."""
    stashed = []
    for folder in sorted(carried.glob(f"{NAME}_part*")):
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            continue
        manifest = json.loads(manifest_path.read_text())
        for part in manifest["parts"]:
            source = folder / part["name"]
            if not source.is_file():
                continue
            if sha256(source) != part["sha256"]:
                raise SystemExit(f"{source}: SHA-256 differs from the manifest's: carry it again")
            for target in stashes:
                try:
                    target.mkdir(parents=True, exist_ok=True)
                    if (
                        not (target / part["name"]).is_file()
                        or sha256(target / part["name"]) != part["sha256"]
                    ):
                        shutil.copyfile(source, target / part["name"])
                    shutil.copyfile(manifest_path, target / MANIFEST)
                except OSError as error:  # a second stash that cannot be written is not fatal
                    say(f"could not stash into {target}: {error}")
            stashed.append(part["name"])
    return stashed


def install(carried: Path, stashes: list[Path], site: Path, probe: str | None = PROBE) -> int:
    """Stash this call's part; once every part is at hand, check them and the whole, unpack into ``site`` and
    run ``probe`` there. 0: installed (or already installed); :data:`INCOMPLETE`: parts are still missing."""
    stashed = stash(carried, stashes)
    if stashed:
        say(f"stashed {', '.join(stashed)} in {', '.join(map(str, stashes))}")
    manifests = _manifests(carried, stashes)
    if not manifests:
        raise SystemExit(
            f"no {NAME}_part*/{MANIFEST} under {carried} nor in the stashes: carry .whl/{NAME}_part1 (benchmarks/"
            "README.md, 'FlashAttention 4')"
        )
    manifest = manifests[0]
    if any(m["sha256"] != manifest["sha256"] for m in manifests):
        say("parts of different preparations were found: using the newest carried one's manifest")
    marker = site / ".installed.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == manifest["sha256"]:
        say(f"already installed in {site} (the same archive)")
        return run_probe(site, probe)
    located = {part["name"]: _locate(part, carried, stashes) for part in manifest["parts"]}
    missing = [part for part in manifest["parts"] if located[part["name"]] is None]
    if missing:
        have = [name for name, path in located.items() if path is not None]
        say(
            f"have {have or 'no part'}; missing {[p['name'] for p in missing]}: make the next call, carrying "
            f"{', '.join('.whl/' + p['folder'] for p in missing)}, while this machine is still warm (~30 s)"
        )
        return INCOMPLETE
    site.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=site.parent) as scratch:  # beside the site: files move, not copy
        whole = Path(scratch) / manifest["archive"]
        with whole.open("wb") as out:
            for part in manifest["parts"]:
                path = located[part["name"]]
                assert path is not None
                with path.open("rb") as handle:
                    shutil.copyfileobj(handle, out, MiB)
        if sha256(whole) != manifest["sha256"]:
            raise SystemExit(
                "the reassembled archive's SHA-256 is not the manifest's: prepare and carry again"
            )
        unpacked = Path(scratch) / "site"
        with lzma.open(whole) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                if member.name.startswith("/") or ".." in Path(member.name).parts or not member.isfile():
                    raise SystemExit(f"refusing archive member {member.name!r}")
                if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: no links, no modes
                    tar.extract(member, unpacked, filter="data")
                else:
                    tar.extract(member, unpacked)
        # file by file into the site, which may hold other packages (flash-attn 2 built into the same folder: its
        # flash_attn package and FA4's flash_attn/cute must share one folder to import both)
        for path in sorted(unpacked.rglob("*")):
            if path.is_file():
                target = site / path.relative_to(unpacked)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
    marker.write_text(json.dumps({"sha256": manifest["sha256"], "wheels": manifest.get("wheels", [])}) + "\n")
    say(f"installed {len(manifest.get('wheels', []))} wheels into {site}")
    return run_probe(site, probe)


def python_path(site: Path) -> str:
    return os.pathsep.join(str(p) for p in (site, site / EXTRA_PATH) if p.is_dir())


def run_probe(site: Path, probe: str | None) -> int:
    if probe is None:
        return 0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [python_path(site), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", probe], env=env)
    if result.returncode != 0:
        say(
            "the installed package did not import (above). If flash-attn 2 is installed elsewhere on the path, "
            "its flash_attn package hides flash_attn.cute: install both into the same folder (--site)"
        )
    return result.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["prepare", "install", "pythonpath"])
    parser.add_argument(
        "--wheels", type=Path, default=REPO / ".whl" / NAME, help="prepare: the downloaded wheels"
    )
    parser.add_argument("--carried", type=Path, default=REPO / ".whl", help="where the part folders are")
    parser.add_argument("--part-mib", type=float, default=PART_MIB, help="prepare: a part's ceiling")
    parser.add_argument("--python-lzma", action="store_true", help="prepare: compress with Python's lzma")
    parser.add_argument(
        "--stash",
        type=Path,
        action="append",
        help="install: stash folders (default: .fa4_stash in the repository, and /tmp/fa4_stash)",
    )
    parser.add_argument("--site", type=Path, default=REPO / ".fa4_site", help="install: the target folder")
    parser.add_argument("--no-probe", action="store_true", help="install: do not import the package after")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.wheels, args.carried, args.part_mib, args.python_lzma)
        return 0
    if args.command == "pythonpath":
        print(python_path(args.site))
        return 0
    stashes = args.stash or [REPO / f".{NAME}_stash", Path(tempfile.gettempdir()) / f"{NAME}_stash"]
    return install(args.carried, stashes, args.site, None if args.no_probe else PROBE)


if __name__ == "__main__":
    sys.exit(main())
