"""Stragglers (pure policy): who is persistently slow, whether replacing it pays, and the
controller's per-node windows (warm-up, recoveries, one-off slow steps)."""

from __future__ import annotations

import pytest

from resild.controller.stragglers import WARMUP_STEPS, Paces, Straggler, find, pays


def test_a_persistently_slow_node_is_found_with_its_slowdown() -> None:
    paces = {"a": [0.10] * 20, "b": [0.10] * 20, "c": [0.15] * 20}
    s = find(paces, window=20, threshold=0.2)
    assert s is not None and s.node == "c" and s.slowdown == pytest.approx(0.5) and s.others_s == pytest.approx(0.1)


def test_under_the_threshold_a_short_window_or_one_node_nobody_is_flagged() -> None:
    assert find({"a": [0.10] * 20, "b": [0.11] * 20}, window=20, threshold=0.2) is None
    assert find({"a": [0.10] * 20, "b": [0.30] * 19}, window=20, threshold=0.2) is None  # b's window not full
    assert find({"a": [0.30] * 20}, window=20, threshold=0.2) is None


def test_a_one_off_slow_step_moves_no_median() -> None:
    b = [0.10] * 19 + [5.0]  # one slow step (a checkpoint, a page fault storm)
    assert find({"a": [0.10] * 20, "b": b, "c": [0.10] * 20}, window=20, threshold=0.2) is None


def test_two_nodes_compare_with_each_other() -> None:
    s = find({"a": [0.10] * 8, "b": [0.13] * 8}, window=8, threshold=0.2)
    assert s is not None and s.node == "b"


def test_replacing_pays_when_the_rest_of_the_run_loses_more_than_a_recovery_costs() -> None:
    s = Straggler("c", 0.5, 0.15, 0.10, 20)
    assert pays(s, steps_left=1000, recovery_s=5.0) == (True, pytest.approx(50.0))
    assert pays(s, steps_left=50, recovery_s=5.0) == (False, pytest.approx(2.5))
    assert pays(s, steps_left=-3, recovery_s=0.0)[0] is False


def test_the_window_skips_each_epochs_first_steps_and_starts_again_at_a_recovery() -> None:
    p = Paces(window=4)
    for step in range(1, WARMUP_STEPS + 1):  # start-up: not judged
        p.add("a", 1, step, 9.0)
    assert p.view() == {}
    p.add("a", 1, WARMUP_STEPS + 3, 0.1, steps=3)  # a report covering three steps
    assert p.view() == {"a": [0.1, 0.1, 0.1]}
    p.add("a", 1, WARMUP_STEPS + 5, 0.2, steps=2)
    assert p.view() == {"a": [0.1, 0.1, 0.2, 0.2]}  # the window keeps the latest 4 steps
    p.add("a", 2, 40, 7.0)  # a new epoch: a recovery's first steps are not judged either
    assert p.view() == {}
    p.add("a", 1, 99, 0.1)  # a late report of the old epoch: dropped
    assert p.view() == {}
    p.add("b", 2, 50, 0.1)
    p.forget("b")
    assert "b" not in p.view()


def test_a_window_longer_than_the_job_is_said_with_what_to_do() -> None:
    from resild.controller.stragglers import WARMUP_STEPS, window_too_long

    assert window_too_long(50, 0) is None  # the job's length not said yet
    assert window_too_long(50, 50 + WARMUP_STEPS) is None
    why = window_too_long(50, 30)
    assert why is not None and "--straggler-window 50 needs 55 steps" in why and "this job has 30" in why
    assert "pass a shorter --straggler-window" in why
