"""bench/shrink.py's pure parts, on hand-made event lists: step times, the next epoch's first
step, one run's durations on either path, the report's view of the same recovery, and the
summary's medians, ratios and spreads (the runs themselves are by hand: each starts local jobs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.shrink import (
    measure,
    median_step_s,
    next_epoch_step,
    report_recovery,
    spread,
    step_times,
    summarize,
    table,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def _ev(event: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": event, "t_mono": t, **fields}


def _progress(t: float, step: int, epoch: int = 1) -> dict[str, Any]:
    return _ev("progress", t, step=step, epoch=epoch)


def test_step_times_are_seconds_per_step_between_progress_points_of_one_epoch_in_the_window() -> None:
    evs = [
        _progress(1.0, 10),
        _progress(1.5, 30),  # 20 steps in 0.5 s: 25 ms
        _progress(2.0, 40),  # 10 in 0.5 s: 50 ms
        _progress(2.5, 40),  # no new step: left out
        _progress(3.0, 45, epoch=2),  # across epochs: left out
        _progress(3.5, 55, epoch=2),  # 10 in 0.5 s: 50 ms
        _progress(9.0, 500, epoch=2),  # outside the window
    ]
    assert step_times(evs, 1.0, 3.5) == pytest.approx([0.025, 0.05, 0.05])
    assert median_step_s(evs, 1.0, 3.5) == pytest.approx(0.05)
    assert median_step_s(evs, 1.2, 1.9) is None  # one point: no pair
    assert median_step_s([_ev("membership", 1.0, epoch=1)], 0.0, 9.0) is None


def test_the_next_epoch_s_first_full_strength_step() -> None:
    evs = [
        _ev("full_strength_step", 1.0, epoch=1),
        _ev("progress", 2.0, epoch=2, step=3),
        _ev("full_strength_step", 3.0, epoch=2),
        _ev("full_strength_step", 4.0, epoch=3),
    ]
    assert next_epoch_step(evs, 1) == evs[2]
    assert next_epoch_step(evs, 2) == evs[3]
    assert next_epoch_step(evs, 3) is None


def _shrink_run() -> list[dict[str, Any]]:
    """3 ranks at 20 ms a step, node0 lost at t=10.0, 2 ranks at 12.5 ms; --join at t=20.0,
    grown at t=28.0, full width (20 ms) again from t=28.1."""
    return [
        _ev("membership", 0.9, epoch=1, layout={"local-node0": [0], "local-node1": [1], "local-node2": [2]}),
        _ev("full_strength_step", 1.0, epoch=1, step=1),
        *(_progress(1.0 + 0.5 * i, 1 + 25 * i) for i in range(18)),  # to t=9.5, step 426
        _ev("collective_failed", 10.02, rank=1, epoch=1),
        _ev("failure_detected", 10.05, node="local-node0", cause="exit", detector="process-exit"),
        _ev("node_fenced", 10.051, node="local-node0"),
        _ev("job_resized", 10.052, how="shrink", node="local-node0", epoch=2, world_size=2),
        _ev("membership", 10.053, epoch=2, layout={"local-node1": [0], "local-node2": [1]}),
        _ev("resumed", 10.09, rank=0, epoch=2, step=426),
        _ev("full_strength_step", 10.15, epoch=2, step=427),
        *(_progress(10.5 + 0.5 * i, 430 + 40 * i, epoch=2) for i in range(19)),  # to t=19.5
        _ev("node_admitted", 20.3, node="local-join1-0", via="join"),
        _ev("job_resized", 28.0, how="grow", node="local-join1-0", epoch=3, world_size=3),
        _ev("membership", 28.001, epoch=3, layout={"local-node1": [0], "local-node2": [1], "local-join1-0": [2]}),
        _ev("full_strength_step", 28.1, epoch=3, step=1200),
        *(_progress(28.5 + 0.5 * i, 1210 + 25 * i, epoch=3) for i in range(4)),  # to t=30.0
    ]


def test_a_shrink_run_s_durations_from_its_events() -> None:
    m = measure(_shrink_run(), "shrink", t_kill=10.0, t_join=20.0, t_end=30.0)
    assert m["recovery_s"] == pytest.approx(0.15)  # the kill -> the shrunk epoch's first full step
    assert m["detect_s"] == pytest.approx(0.05) and m["decided_s"] == pytest.approx(0.052)
    assert m["full_step_s"] == pytest.approx(0.02)
    assert m["shrunk_step_s"] == pytest.approx(0.0125)
    assert m["grow_decided_s"] == pytest.approx(8.0)  # --join -> job_resized grow
    assert m["grow_full_s"] == pytest.approx(8.1)  # --join -> the grown epoch's first full step
    assert m["grow_s"] == pytest.approx(0.1)
    assert m["grown_step_s"] == pytest.approx(0.02)


def test_a_spare_run_s_durations_and_runs_that_never_got_there() -> None:
    evs = [
        _ev("full_strength_step", 1.0, epoch=1, step=1),
        *(_progress(1.0 + 0.5 * i, 1 + 25 * i) for i in range(18)),
        _ev("failure_detected", 10.04, node="local-node0"),
        _ev("spare_assigned", 10.041, failed="local-node0", spare="local-node3", epoch=2),
        _ev("full_strength_step", 10.12, epoch=2, step=427),
    ]
    m = measure(evs, "spare", t_kill=10.0)
    assert m == pytest.approx({"recovery_s": 0.12, "detect_s": 0.04, "decided_s": 0.041, "full_step_s": 0.02})
    stuck = measure(evs[:-1], "spare", t_kill=10.0)
    assert stuck["recovery_s"] is None and stuck["decided_s"] == pytest.approx(0.041)
    # a shrink that never grew: no grow measures, and no step time past the join
    m = measure([e for e in _shrink_run() if e["t_mono"] < 20.0], "shrink", t_kill=10.0, t_join=20.0, t_end=None)
    assert m["grow_decided_s"] is None and m["grow_full_s"] is None and m["grow_s"] is None
    assert "grown_step_s" not in m and m["shrunk_step_s"] == pytest.approx(0.0125)


def test_the_report_times_a_shrink_as_its_failure_s_recovery_from_the_failed_collective() -> None:
    # resild report cannot know the kill: it starts at the first failed collective
    assert report_recovery(_shrink_run()) == (pytest.approx(0.13), "collective failure")
    assert report_recovery([_ev("full_strength_step", 1.0, epoch=1)]) == (None, None)


def _runs() -> list[dict[str, Any]]:
    return [
        {"path": "spare", "recovery_s": 0.10, "decided_s": 0.04},
        {"path": "shrink", "recovery_s": 0.15, "full_step_s": 0.020, "shrunk_step_s": 0.012, "grow_s": 0.07},
        {"path": "shrink", "recovery_s": 0.12, "full_step_s": 0.020, "shrunk_step_s": 0.014, "grow_s": 0.08},
        {"path": "spare", "recovery_s": 0.12, "decided_s": 0.05},
        {"path": "spare", "recovery_s": 0.11, "decided_s": None},
        {"path": "shrink", "recovery_s": None, "full_step_s": 0.025, "shrunk_step_s": 0.015},  # never back
    ]


def test_the_summary_s_medians_ratios_and_spreads() -> None:
    s = summarize(_runs(), nodes=3)
    assert s["spare_recovery_s"] == {"median": 0.11, "min": 0.10, "max": 0.12}
    assert s["shrink_recovery_s"] == {"median": 0.135, "min": 0.12, "max": 0.15}
    assert s["spare_decided_s"] == {"median": 0.045, "min": 0.04, "max": 0.05}
    # B/A: the ratio of the medians; its spread over the pairs (round i's shrink / round i's spare)
    assert s["recovery_ratio"] == {"median": pytest.approx(1.227), "min": 1.0, "max": 1.5, "pairs": [1.5, 1.0, None]}
    # step time shrunk / full, per shrink run: 0.6, 0.7, 0.6
    assert s["step_ratio"] == {"median": 0.6, "min": 0.6, "max": 0.7}
    # samples/s shrunk / full = (2/3) / step ratio: the slowest shrunk step gives the min
    assert s["samples_ratio"] == {"median": 1.111, "min": 0.952, "max": 1.111}
    assert s["grow_s"] == {"median": 0.075, "min": 0.07, "max": 0.08}
    assert s["grown_step_ratio"] == {"median": None, "min": None, "max": None}
    assert spread([None, 2.0, 1.0]) == (1.0, 2.0) and spread([None]) is None


def test_the_table_has_a_row_per_measure_and_dashes_for_none() -> None:
    out = table(summarize(_runs(), nodes=3), runs=3).splitlines()
    assert "median of 3 (min-max)" in out[0]
    row = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in out[1:])
    assert row["(A) spare takes over: kill -> full strength"] == "0.110 s (0.100-0.120)"
    assert row["B / A (of the medians; the pairs' min-max)"] == "1.227 (1.000-1.500)"
    assert row["shrunk / full step time"] == "0.600 (0.600-0.700)"
    assert row["(D) step time, full width"] == "20.0 ms (20.0-25.0)"
    assert row["grown / full step time"] == "-"


@pytest.mark.parametrize("args", [["--nodes", "1"], ["--runs", "0"], ["--window-s", "0"], ["--victim", "local-node3"]])
def test_bad_input_is_one_usage_line(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "bench/shrink.py", *args], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "error:" in r.stderr, r.stderr
