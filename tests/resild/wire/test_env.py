"""The RESILD_* registry is the one list: the code reads no variable it lacks, and the
README shows every one of them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from resild.wire.env import CFG_PREFIX, REGISTRY, markdown_table

REPO = Path(__file__).resolve().parents[3]


def _names_in(paths: list[str]) -> set[str]:
    out = subprocess.run(
        ["git", "grep", "-ohE", r"RESILD_[A-Z0-9_]+", "--", *paths], cwd=REPO, capture_output=True, text=True
    )
    return set(out.stdout.split())


def test_every_variable_the_code_names_is_registered() -> None:
    known = {v.name for v in REGISTRY}
    used = {n for n in _names_in(["resild", "launcher", "plugins"]) if not n.startswith(CFG_PREFIX)}
    assert used - known == set(), "add these to resild/wire/env.py (and the README's table)"


def test_names_are_unique_and_daemon_keys_have_their_own_prefix() -> None:
    names = [v.name for v in REGISTRY]
    assert len(names) == len(set(names))
    assert not any(n.startswith(CFG_PREFIX) for n in names if n != CFG_PREFIX + "<KEY>")


def test_the_readme_shows_the_registry() -> None:
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme, "paste `python -m resild.wire.env` into the README"
    for v in REGISTRY:
        assert re.search(re.escape(f"`{v.name}`"), readme)
