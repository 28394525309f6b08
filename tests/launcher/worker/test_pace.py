"""A rank's pace: the step's start to its arrival at commit, summed; the injected slowdown;
off (--stragglers off, WELCOME's `pace`): nothing measured nor reported."""

from __future__ import annotations

import json
import time

import pytest

from launcher.worker.pace import Pace
from resild.wire.settings import JobSettings, WorkerRedundancy


def test_a_pace_spans_the_step_to_the_commit_and_adds_up() -> None:
    p = Pace()
    assert p.arrived() == 0.0 and p.total_s == 0.0  # a commit outside the loop: nothing to time
    p.opened()
    time.sleep(0.02)
    first = p.arrived()
    assert 0.02 <= first < 0.5
    assert p.arrived() == 0.0  # the same step does not count twice
    p.opened()
    second = p.arrived()
    assert p.total_s == pytest.approx(first + second)


def test_an_injected_slowdown_adds_its_share_of_the_step() -> None:
    p = Pace()
    p.slow_pct = 100
    p.opened()
    time.sleep(0.03)
    assert p.arrived() >= 0.06


def test_an_on_pace_measures_and_reports_its_total() -> None:
    p = Pace(enabled=True)
    p.opened()
    time.sleep(0.01)
    assert p.arrived() >= 0.01 and p.total_s >= 0.01
    assert p.report() == {"paced_s": round(p.total_s, 6)}


def test_an_off_pace_measures_nothing_and_reports_nothing() -> None:
    p = Pace(enabled=False)  # --stragglers off
    p.opened()
    time.sleep(0.01)
    assert p.arrived() == 0.0 and p.total_s == 0.0
    assert p.report() == {}  # no paced_s in the commit report: the node sends no paces


def test_an_off_pace_still_slows_an_injected_straggler() -> None:
    p = Pace(enabled=False)
    p.slow_pct = 100  # set at a commit: the next step is timed to be slowed in proportion
    p.opened()
    t0 = time.monotonic()
    time.sleep(0.03)
    assert p.arrived() == 0.0 and p.total_s == 0.0
    assert time.monotonic() - t0 >= 0.06


def test_the_switch_travels_in_welcome() -> None:
    for action, on in (("replace", True), ("report", True), ("off", False)):
        sent = JobSettings(stragglers=action).worker_redundancy()
        assert sent.pace is on
        assert WorkerRedundancy.from_welcome(json.loads(json.dumps(sent.to_dict()))).pace is on
    assert WorkerRedundancy.from_welcome({}).pace is True  # a worker run alone
    assert WorkerRedundancy.from_welcome({"pace": 0}).pace is True  # not a bool: the default
