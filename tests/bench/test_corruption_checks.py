"""bench/corruption_checks.py: bad input is a usage line, and the summary's ratios are
against the variants they name (the runs themselves are by hand: six local jobs a round)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.corruption_checks import summarize

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["--runs", "0"], ["--steps", "5"]])
def test_bad_input_is_one_usage_line(args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "bench/corruption_checks.py", *args], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr


def test_ratios_are_against_no_fingerprints_and_the_copy_against_compares_alone() -> None:
    runs = [
        {"variant": "off", "step_ms": 20.0},
        {"variant": "off", "step_ms": 22.0},
        {"variant": "m10-nocopy", "step_ms": 21.0},
        {"variant": "m10", "step_ms": 23.1, "capture_ms": 3.0, "held_kb": 100.0},
        {"variant": "m1", "error": ["boom"]},
        {"variant": "v1", "step_ms": 42.0, "verified": 600},
    ]
    s = summarize(runs)
    assert s["off"]["step_ms"] == 21.0 and s["off"]["ratio"] == 1.0
    assert s["m10"]["ratio"] == 1.1 and s["m10"]["copy_ratio"] == 1.1 and s["m10"]["held_kb"] == 100.0
    assert s["m1"] == {"step_ms": None, "ratio": None, "capture_ms": None, "held_kb": None, "runs": 0}
    assert s["v1"]["ratio"] == 2.0 and s["v1"]["per_verified_step"] == 1.0
