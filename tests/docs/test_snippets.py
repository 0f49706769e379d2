"""Every ```python block of the README and of docs/*.md runs, in order, one namespace per page, in a fresh folder,
on CPU. A block that cannot run here (GPUs, several processes) starts with ``# needs: <what>; tested by
tests/<file>.py`` and is not run: the test named there must exist."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
NEEDS = re.compile(r"\A# needs: .+?; tested by (tests/\S+\.py)")


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


def test_every_page_is_checked() -> None:
    assert {p.name for p in PAGES} >= {"README.md", "getting-started.md", "degrees.md", "models.md"}
    assert sum(len(python_blocks(p)) for p in PAGES) > 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for number, block in enumerate(python_blocks(page), 1):
        needs = NEEDS.match(block)
        if needs is not None:
            assert (ROOT / needs.group(1)).is_file(), f"{page.name} block {number} names a missing test"
            continue
        assert not block.startswith("# needs:"), (
            f"{page.name} block {number}: '# needs: ...; tested by <path>'"
        )
        try:
            exec(compile(block, f"{page.name}[block {number}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page.name}, python block {number} failed:\n{block}") from error
    assert os.getcwd() == str(tmp_path)
