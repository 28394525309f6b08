"""--snapshot-every auto's pure parts: the cadence a measured cost asks for, the vote's
one-hot terms and what their sums agree on, and the meter fed by an injected clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from launcher.worker.redundancy.snapshot_budget import (
    BUCKETS,
    CLEAN_NEEDED,
    PROBE_EVERY,
    STALE_COMMITS,
    WARMUP_INTERVALS,
    SnapshotMeter,
    agreed,
    bucket,
    vote_terms,
    wanted_every,
)


def test_the_cadence_is_the_fewest_steps_that_keep_the_cost_under_the_budget() -> None:
    assert wanted_every(0.0, 0.1, 0.02) == 1
    assert wanted_every(0.002, 0.1, 0.02) == 1  # 2 ms of a 100 ms step: 2%
    assert wanted_every(0.0021, 0.1, 0.02) == 2
    assert wanted_every(0.05, 0.1, 0.02) == 32  # 50 ms: 25 steps at least, so 32
    assert wanted_every(10.0, 0.1, 0.02) == BUCKETS[-1]  # never more than 1024 steps apart
    assert wanted_every(0.01, 0.0, 0.02) == BUCKETS[-1]


@given(st.lists(st.sampled_from(BUCKETS), min_size=1, max_size=50))
def test_the_summed_vote_agrees_on_the_largest_cadence_asked(asks: list[int]) -> None:
    sums = [sum(col) for col in zip(*(vote_terms(e) for e in asks), strict=True)]
    assert agreed(sums) == max(asks)
    assert sum(sums) == len(asks)


def test_a_vote_nobody_took_part_in_agrees_on_nothing_and_a_wrong_length_is_refused() -> None:
    assert agreed([0] * len(BUCKETS)) is None
    with pytest.raises(ValueError, match="terms"):
        agreed([1, 0])
    assert bucket(3) == 4 and bucket(1) == 1 and bucket(10**6) == BUCKETS[-1]
    assert vote_terms(5) == vote_terms(8)


def test_the_meter_asks_for_the_probe_until_it_has_measured() -> None:
    m = SnapshotMeter(0.02)
    assert m.want().every == PROBE_EVERY and m.want().cost_s is None
    t = 0.0
    m.commit(t, confirmed=False, started=True)  # a snapshot at once: no clean interval yet
    t += 0.02
    m.commit(t, confirmed=True, started=False)  # its cost cannot be told without a clean step
    for i in range(CLEAN_NEEDED - 1):  # started with too few steps timed before it
        t += 0.01
        m.commit(t, confirmed=False, started=i == CLEAN_NEEDED - 2)
    t += 0.5  # (the loop's warm-up)
    m.commit(t, confirmed=True, started=False)  # not counted
    assert m.want().every == PROBE_EVERY
    for i in range(CLEAN_NEEDED):
        t += 0.01
        m.commit(t, confirmed=False, started=i == CLEAN_NEEDED - 1)
    t += 0.013
    m.commit(t, confirmed=True, started=False)  # 3 ms over a 10 ms step
    w = m.want()
    assert w.every == 16 and w.cost_s == pytest.approx(0.003) and w.step_s == pytest.approx(0.01)
    assert "3.0 ms a snapshot, 10.0 ms a step" == w.reason


def warmed(m: SnapshotMeter, step_s: float = 0.01) -> float:
    """The loop's first intervals (ignored, here 50x slower); -> the clock after them."""
    t = 0.0
    for _ in range(WARMUP_INTERVALS + 1):
        t += 50 * step_s
        m.commit(t, confirmed=False, started=False)
    assert not m._clean
    return t


def test_a_recovery_measures_nothing_across_it_nor_the_warm_up_after_it() -> None:
    m = SnapshotMeter(0.02)
    t = warmed(m)
    for i in range(CLEAN_NEEDED + 1):
        t += 0.01
        m.commit(t, confirmed=False, started=i == CLEAN_NEEDED)
    m.interrupted()  # the snapshot in flight died with the epoch
    t += 30.0  # the recovery
    m.commit(t, confirmed=True, started=False)
    assert m.want().every == PROBE_EVERY  # no cost learned, and no 30 s step
    for _ in range(WARMUP_INTERVALS):  # warming up again: not a step's own time
        t += 0.5
        m.commit(t, confirmed=False, started=False)
    t += 0.01
    m.commit(t, confirmed=False, started=False)
    assert max(m._clean) == pytest.approx(0.01)


def test_back_to_back_snapshots_re_measure_the_step_instead_of_trusting_an_old_one() -> None:
    # Snapshots free at first (cadence 1, back to back), then the loop gets faster and a
    # snapshot costs 50 ms: with no clean step to compare to, a 200 ms baseline would call
    # it free for ever. After STALE_COMMITS the rank asks for steps between them again.
    m = SnapshotMeter(0.02)
    t = warmed(m, 0.2)
    asked = []
    started = False
    for n in range(400):
        every = m.want().every
        asked.append(every)
        fast = n > 40
        t += 0.1 if fast else 0.2
        if started and fast:
            t += 0.05  # the interval after a snapshot's start pays for it
        started = n % every == 0
        m.commit(t, confirmed=True, started=started)
    assert asked[30] == 1  # free: every step
    assert asked[-1] == 32, asked[-20:]  # 50 ms / (32 x 100 ms) < 2%
    assert PROBE_EVERY in asked[40 : 40 + STALE_COMMITS + 20]  # re-measured on the way


def test_a_cost_near_a_buckets_edge_does_not_flip_the_cadence_back_and_forth() -> None:
    m = SnapshotMeter(0.02)
    t = warmed(m, 0.1)

    def snapshot(cost_s: float) -> int:
        nonlocal t
        for i in range(CLEAN_NEEDED):
            t += 0.1
            m.commit(t, confirmed=False, started=i == CLEAN_NEEDED - 1)
        t += 0.1 + cost_s
        m.commit(t, confirmed=True, started=False)
        return m.want().every

    assert snapshot(0.0165) == 16  # 16.5 ms over 100 ms steps: > 2% of 8 steps (16 ms)
    assert [snapshot(c) for c in (0.0155, 0.0155, 0.0155)] == [16, 16, 16]  # the median would fit 8, barely
    assert [snapshot(c) for c in (0.010, 0.010, 0.010)] == [16, 16, 8]  # well under (median of 5): down
    assert [snapshot(0.05) for _ in range(3)] == [8, 8, 32]  # up as soon as the median is over
