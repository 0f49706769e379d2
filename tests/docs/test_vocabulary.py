"""The pages, the code and the tests speak of the product, not of how it was built: no work-log vocabulary (a
numbered session or issue of our own, a device lease, "the GPU machine", "this box"), and every speed ratio in the
README's speed table is one that docs/benchmarks.md states, so the front page quotes a measured run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEED_TABLE = re.compile(r"<!-- speed-table:start -->(.*?)<!-- speed-table:end -->", re.DOTALL)
RATIO = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[x×](?!\w)")

# Built from pieces so that this file does not match its own patterns. An upstream issue is cited as
# ``owner/repo#N``, which none of these match.
_ISSUE = "iss" + "ue"
_SESSION = "sess" + "ion"
WORK_LOG = re.compile(
    "|".join(
        (
            rf"\b{_SESSION}[\s-]*#?\d",  # "session 26", "session-6"
            rf"\b{_ISSUE}\s*#?\d",  # "issue 28", "issue #28"
            r"\blea" + r"ses?\b",  # a device lease (not "release", "please")
            r"\bthe GPU mach" + r"ine\b",
            r"\bthis b" + r"ox\b",
        )
    ),
    re.IGNORECASE,
)


def _checked_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    for folder in ("lightning_d9d", "tests", "examples"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".yaml", ".yml"})
    benchmarks = ROOT / "benchmarks"
    files += [benchmarks / "README.md", *sorted(benchmarks.glob("*.py")), *sorted(benchmarks.glob("*.sh"))]
    files += sorted((benchmarks / "throughput").glob("*.py"))
    here = Path(__file__).resolve()
    return [p for p in files if p.is_file() and p.resolve() != here]


FILES = _checked_files()


def test_the_checked_files_include_the_package_tests_and_pages() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"README.md", "CONTRIBUTING.md", "docs/benchmarks.md", "lightning_d9d/__init__.py"} <= names
    assert any(name.startswith("tests/") for name in names)


def work_log_hits(text: str) -> list[str]:
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        match = WORK_LOG.search(line)
        if match is not None:
            hits.append(f"{number}: {match.group(0)!r} in {line.strip()}")
    return hits


@pytest.mark.parametrize(
    "text", ["the tolerance of " + _SESSION + " 23", "see " + _ISSUE + " #28", "one lea" + "se"]
)
def test_the_patterns_find_work_log_words(text: str) -> None:
    assert work_log_hits(text)


@pytest.mark.parametrize(
    "text",
    ["a new release", "please", "a Trainer " + _SESSION, "pytorch/torchtitan#3427", "issues in the tracker"],
)
def test_the_patterns_leave_ordinary_words(text: str) -> None:
    assert not work_log_hits(text)


def test_no_work_log_vocabulary() -> None:
    found = []
    for path in FILES:
        found += [
            f"{path.relative_to(ROOT)}:{hit}" for hit in work_log_hits(path.read_text(errors="replace"))
        ]
    assert not found, (
        "work-log vocabulary (say what the code does and which benchmark run measured it):\n"
        + ("\n".join(found))
    )


def ratios(text: str) -> set[str]:
    return {match.group(1) for match in RATIO.finditer(text)}


def missing_ratios(readme: str, benchmarks: str) -> list[str]:
    """The ratios of the README's speed table that the benchmarks page does not state."""
    table = SPEED_TABLE.search(readme)
    assert table is not None, "README.md lost its <!-- speed-table:start/end --> markers"
    quoted = ratios(table.group(1))
    assert quoted, "the README's speed table quotes no ratio"
    return sorted(quoted - ratios(benchmarks))


def test_readme_speed_ratios_are_in_the_benchmarks_page() -> None:
    missing = missing_ratios((ROOT / "README.md").read_text(), (ROOT / "docs" / "benchmarks.md").read_text())
    assert not missing, f"README speed ratios not in docs/benchmarks.md: {missing}"


def test_a_ratio_the_page_does_not_state_is_named() -> None:
    readme = "<!-- speed-table:start -->\n| 0.6B | 1.26x | 1.31× |\n<!-- speed-table:end -->"
    assert missing_ratios(readme, "| U1 | 1.26x |") == ["1.31"]


def test_a_ratio_is_read_with_either_sign() -> None:
    assert ratios("1.26x and 1.52× but not seq 4096 × 4 or 0x1f") == {"1.26", "1.52"}
