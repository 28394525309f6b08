"""bench/join_spare.py: bad input is a usage line, not a traceback (the runs themselves are
by hand: each starts two local jobs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["--nodes", "1"], ["--runs", "0"]])
def test_bad_input_is_one_usage_line(args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "bench/join_spare.py", *args], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
