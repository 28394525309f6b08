"""bench/peers_torchft.py's analysis on a synthetic torchft event log (no torchft needed)."""

from __future__ import annotations

import pytest

from bench.peers_torchft import analyze_torchft

pytestmark = pytest.mark.timeout(30)


def step(t: float, s: int, participants: int, group: int = 0) -> dict:
    return {"event": "step", "t_wall": t, "step": s, "participants": participants, "group": group, "rank": 0}


def test_stall_reduced_strength_and_rejoin():
    ev = [step(100 + 0.1 * k, k, 2) for k in range(1, 11)]  # steps 1..10, 0.1 s, both groups
    ev.append({"event": "fault_injected", "t_wall": 101.05, "step": 10, "group": 1, "rank": 0})
    ev += [step(106.0 + 0.05 * i, 11 + i, 1) for i in range(4)]  # 5 s stall, 4 steps alone
    ev += [step(106.3 + 0.1 * i, 15 + i, 2) for i in range(3)]  # group 1 back at step 15
    r = analyze_torchft(sorted(ev, key=lambda e: e["t_wall"]), groups=2)
    assert r["training_again_s"] == pytest.approx(106.0 - 101.05)
    assert r["full_strength_s"] == pytest.approx(106.3 - 101.05)
    assert r["steps_reduced"] == 4 and r["steps_redone"] == 0 and r["steps"] == 17
    assert r["step_time_s"] == pytest.approx(0.1)
    # lost: the stall + 4 steps x half the samples x the full-strength step
    assert r["lost_s"] == pytest.approx(4.95 + 4 * 0.5 * 0.1)
    work = (9 + 4 * 0.5 + 3) * 0.1  # commits after the first, weighted by participants
    assert r["goodput"] == pytest.approx(work / (106.5 - 100.1))


def test_rollback_counts_redone_steps():
    ev = [step(10 + k, k, 2) for k in range(1, 6)]
    ev.append({"event": "fault_injected", "t_wall": 15.5, "step": 5, "group": 1, "rank": 0})
    ev += [step(20 + k, 3 + k, 2) for k in range(1, 4)]  # resumed at 4: 4 and 5 redone
    r = analyze_torchft(sorted(ev, key=lambda e: e["t_wall"]), groups=2)
    assert r["steps_redone"] == 2
