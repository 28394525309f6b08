"""bench/stragglers.py: its quickest mode runs and says every field (tiny jobs: the shape,
not the numbers), the phases are read from the events they name, and bad input is one
usage line (the default-size runs are by hand: eight local jobs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stragglers import phases

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_quick_mode_runs_both_measurements_and_says_every_field() -> None:
    r = subprocess.run(
        [sys.executable, "bench/stragglers.py", "--quick", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    runs, s = out["runs"], out["summary"]
    assert sorted(x["variant"] for x in runs["pace_overhead"]) == ["off", "on"]
    assert sorted(x["variant"] for x in runs["slow_node"]) == ["replace", "report"]
    assert not [x for x in runs["pace_overhead"] + runs["slow_node"] if "error" in x], runs
    pace = s["pace_overhead"]
    for key in ("on_step_ms", "off_step_ms", "ratio", "on_runs_ms", "off_runs_ms", "false_stragglers"):
        assert key in pace, pace
    assert pace["on_step_ms"] > 0 and pace["off_step_ms"] > 0
    slow = s["slow_node"]
    assert {"threshold", "window", "job", "train_ratio"} <= set(slow) and "slow:node1@" in slow["job"]
    for name in ("replace", "report"):
        keys = ("train_s", "before_sps", "during_sps", "after_sps", "detect_s", "replace_s", "regained")
        assert set(slow[name]) == {*keys, "replaced", "replaced_other"}
    assert all(x["fault_step"] is not None for x in runs["slow_node"])  # the slowdown was injected


@pytest.mark.timeout(60)
def test_phases_are_read_around_the_fault_the_straggler_and_the_new_epoch() -> None:
    def ev(t: float, name: str, **kw: object) -> dict[str, object]:
        return {"event": name, "t_mono": t, **kw}

    events = [
        ev(0.0, "full_strength_step", epoch=1, step=1),
        ev(1.0, "progress", step=11, epoch=1),
        ev(2.0, "progress", step=21, epoch=1),
        ev(2.0, "fault_injected", node="local-node1", step=21),
        ev(4.0, "progress", step=31, epoch=1),
        ev(5.0, "straggler", node="local-node1", slowdown=0.4, replaced=False),
        ev(6.0, "straggler", node="local-node1", slowdown=0.4, replaced=True),
        ev(6.0, "progress", step=41, epoch=1),
        ev(6.0, "failure_detected", node="local-node1", committed_step=41),
        ev(6.5, "full_strength_step", epoch=2, step=42),
        ev(7.5, "progress", step=52, epoch=2),
        ev(8.5, "progress", step=62, epoch=2),
        ev(8.5, "job_finished", step=62),
    ]
    p = phases(events)
    assert (p["before_sps"], p["during_sps"], p["after_sps"]) == (10.0, 5.0, 10.0)
    assert (p["detect_s"], p["replace_s"], p["regained"], p["replaced"]) == (3.0, 0.5, 1.0, True)
    assert p["replaced_at_step"] == 41 and p["fault_step"] == 21 and p["replaced_node"] == "local-node1"
    kept = phases([e for e in events if e["t_mono"] <= 5.0])  # reported only: slowed to the end
    assert kept["replaced"] is False and kept["after_sps"] is None and kept["during_sps"] == 5.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--runs", "0"], ["--window", "1"], ["--slow-at", "900"], ["--bogus"]])
def test_bad_input_is_one_usage_line(args: list[str]) -> None:
    r = subprocess.run(
        [sys.executable, "bench/stragglers.py", *args], cwd=REPO, capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if "error:" in line]) == 1, r.stderr
