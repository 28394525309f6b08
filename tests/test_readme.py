"""The README a newcomer reads: short, in the agreed order, its "Where things are" list true to
the tree, and its links into docs/ alive.

The list's format is one entry per line, nothing else in the section starting with "- ":

    - `PATH` — the process that runs it: what it owns

PATH is relative to the repository root; a directory ends in "/". Every package directory (one with
an __init__.py) under resild/, launcher/ and plugins/ must have its entry, and every PATH named must
exist (a directory under those roots must be a package).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PACKAGE_ROOTS = ("resild", "launcher", "plugins")
MAX_LINES = 450
ENTRY = re.compile(r"^- `([^`\s]+)`")
DOCS_LINK = re.compile(r"\]\((docs/[^)#\s]*)(?:#[^)\s]*)?\)")
SECTIONS = (
    "Quick start",
    "Running jobs",
    "Under Slurm",
    "Making a training loop resilient",
    "How recovery works",
    "Where things are",
    "Known limits (honest list)",
)


def _lines() -> list[str]:
    return README.read_text().splitlines()


def _section(title: str) -> list[str]:
    lines = _lines()
    start = lines.index(f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def _named() -> list[str]:
    section = _section("Where things are")
    odd = [line for line in section if line.startswith("- ") and not ENTRY.match(line)]
    assert not odd, f"entries must read '- `PATH` — process: what it owns', one line each: {odd}"
    return [m.group(1) for line in section if (m := ENTRY.match(line))]


def _packages_in_tree() -> set[str]:
    found = set()
    for root in PACKAGE_ROOTS:
        for init in (REPO / root).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(init.parent.relative_to(REPO).as_posix() + "/")
    return found


def _is_package_root_path(path: str) -> bool:
    return path.split("/", 1)[0] in PACKAGE_ROOTS


def test_the_readme_is_short() -> None:
    assert len(_lines()) <= MAX_LINES, (
        f"README.md has {len(_lines())} lines (at most {MAX_LINES}): move detail to docs/"
    )


def test_the_sections_a_newcomer_needs_come_in_order() -> None:
    headings = [line[3:] for line in _lines() if line.startswith("## ")]
    assert [h for h in headings if h in SECTIONS] == list(SECTIONS)


def test_the_list_parses() -> None:
    named = _named()
    assert len(named) == len(set(named)), "a path is listed twice"
    assert {"resild/", "launcher/"} <= set(named)


def test_every_path_the_list_names_exists() -> None:
    missing = []
    for path in _named():
        target = REPO / path
        if path.endswith("/") and _is_package_root_path(path):
            ok = (target / "__init__.py").is_file()
        elif path.endswith("/"):
            ok = target.is_dir()
        else:
            ok = target.is_file()
        if not ok:
            missing.append(path)
    assert not missing, f"'Where things are' names what the tree lacks: {missing}"


def test_every_package_in_the_tree_is_listed() -> None:
    unlisted = sorted(_packages_in_tree() - set(_named()))
    assert not unlisted, f"add a line to 'Where things are' for: {unlisted}"


def test_links_into_docs_resolve() -> None:
    targets = DOCS_LINK.findall(README.read_text())
    assert targets, "the README links to no docs/ file"
    dead = sorted({t for t in targets if not (REPO / t).is_file()})
    assert not dead, f"README links to missing files: {dead}"


def test_the_readme_states_where_tests_live() -> None:
    assert "(resild/x/y.py -> tests/resild/x/test_y.py)" in " ".join(_lines())
