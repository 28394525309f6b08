"""When to snapshot (Cadence) and what a commit and a recovery do to the snapshots
(SnapshotManager), with a stand-in exchanger: no threads, no process groups."""

from __future__ import annotations

from typing import Any

import torch

from launcher.worker.redundancy.snapshot_budget import PROBE_EVERY, vote_terms
from launcher.worker.redundancy.snapshot_cadence import AUTO_EVERY, FAILED, Cadence, SnapshotManager
from launcher.worker.redundancy.snapshot_store import Frozen, SnapshotStore


def run(c: Cadence, commits: list[tuple[int, bool]]) -> list[tuple[int | None, bool]]:
    return [c.on_commit(step, confirmed) for step, confirmed in commits]


def test_every_one_starts_a_snapshot_at_each_commit_once_the_last_is_confirmed() -> None:
    c = Cadence(1)
    assert run(c, [(1, False), (2, True), (3, True), (4, True)]) == [(None, True), (1, True), (2, True), (3, True)]
    assert c.pending == 4 and c.last_started == 4


def test_a_due_snapshot_is_skipped_not_queued_while_the_last_is_unconfirmed() -> None:
    c = Cadence(1)
    assert c.on_commit(1, confirmed=False) == (None, True)
    assert run(c, [(2, False), (3, False)]) == [(None, False), (None, False)]  # skipped: 1 still in flight
    assert c.on_commit(4, confirmed=True) == (1, True)  # confirmed: one snapshot, of step 4, not of 2 and 3
    assert c.on_commit(5, confirmed=True) == (4, True)


def test_every_n_spaces_the_snapshots_n_commits_apart() -> None:
    c = Cadence(3)
    started = [s for s in range(1, 14) if c.on_commit(s, confirmed=True)[1]]
    assert started == [1, 4, 7, 10, 13]


def test_every_n_confirms_at_the_next_commit_and_a_late_confirmation_starts_at_once() -> None:
    c = Cadence(3)
    assert c.on_commit(1, False) == (None, True)
    assert c.on_commit(2, True) == (1, False)  # confirmed, but the next is not due before step 4
    assert c.on_commit(3, True) == (None, False)
    assert c.on_commit(4, False) == (None, True)
    assert c.on_commit(7, False) == (None, False)  # due, step 4's still in flight: skipped
    assert c.on_commit(8, True) == (4, True)  # due since 7: starts now, and the spacing counts from 8
    assert [s for s in range(9, 15) if c.on_commit(s, True)[1]] == [11, 14]


def test_after_recovery_the_next_commit_starts_a_snapshot() -> None:
    c = Cadence(5)
    assert c.on_commit(10, False) == (None, True)
    c.after_recovery(7)  # rolled back to 7; the copies in flight died with the epoch
    assert c.pending is None
    assert c.on_commit(8, False) == (None, True)
    assert c.on_commit(9, True) == (8, False)


class FakeExchanger:
    def __init__(self) -> None:
        self.started: list[Frozen] = []
        self.running = False
        self.abandoned = 0
        self.failed: str | None = None

    def busy(self) -> bool:
        return self.running

    def start(self, f: Frozen) -> None:
        self.started.append(f)
        self.running = True

    def abandon(self) -> None:
        self.abandoned += 1
        self.running = False


def manager(every: int = 1) -> tuple[SnapshotManager, FakeExchanger, dict[str, Any]]:
    live: dict[str, Any] = {"w": torch.zeros(4), "step": 0}
    ex = FakeExchanger()

    def capture() -> tuple[Any, Any]:
        return {"w": live["w"]}, {"step": live["step"]}

    m = SnapshotManager(SnapshotStore(rank=2), ex, every, capture)  # type: ignore[arg-type]
    return m, ex, live


def train(live: dict[str, Any], step: int) -> None:
    live["w"].add_(1.0)
    live["step"] = step


def test_the_vote_flag_is_one_while_the_exchange_runs() -> None:
    m, ex, live = manager()
    assert m.vote_flag() == 0
    m.after_commit(1, vote_sum=1)
    assert m.vote_flag() == 1
    ex.running = False
    assert m.vote_flag() == 0


def test_a_commit_captures_keeps_and_sends_a_snapshot_of_the_live_state() -> None:
    m, ex, live = manager()
    train(live, 1)
    m.after_commit(1, vote_sum=1)
    assert m.taken == 1 and m.skipped == 0 and m.capture_s >= 0
    (f,) = ex.started
    assert (f.step, f.src) == (1, 2) and m.store.get(2, 1) is f
    train(live, 2)  # the next step changes the live tensors, not the snapshot
    state, aux = f.thaw()
    assert torch.equal(state["w"], torch.ones(4)) and aux == {"step": 1}


def test_an_unconfirmed_exchange_skips_the_due_snapshots_and_a_confirmed_one_drops_the_older() -> None:
    m, ex, live = manager()
    m.after_commit(1, vote_sum=1)
    m.after_commit(2, vote_sum=1)  # the vote said some rank's exchange still runs
    m.after_commit(3, vote_sum=1)
    assert (m.taken, m.skipped) == (1, 2)
    assert sorted(m.store.own) == [1]
    ex.running = False
    m.after_commit(4, vote_sum=0)  # step 1 confirmed everywhere: kept until 4 is confirmed too
    assert (m.taken, m.skipped) == (2, 2)
    assert sorted(m.store.own) == [1, 4] and [f.step for f in ex.started] == [1, 4]
    m.after_commit(5, vote_sum=0)  # 4 confirmed: 1 is no longer needed
    assert sorted(m.store.own) == [4, 5]
    assert m.taken == 3


def test_confirm_also_drops_the_older_copies_held_for_others() -> None:
    m, ex, live = manager()
    m.after_commit(1, vote_sum=1)
    m.store.keep_held(Frozen.capture(1, 0, {"w": torch.ones(2)}, {}).seal())
    m.after_commit(2, vote_sum=0)
    m.store.keep_held(Frozen.capture(2, 0, {"w": torch.ones(2)}, {}).seal())
    m.after_commit(3, vote_sum=0)
    assert sorted(m.store.held[0]) == [2] and sorted(m.store.own) == [2, 3]


def test_every_n_takes_one_snapshot_per_n_commits_and_counts_no_skip_in_between() -> None:
    m, ex, live = manager(every=4)
    for s in range(1, 10):
        m.after_commit(s, vote_sum=0)
    assert [f.step for f in ex.started] == [1, 5, 9] and (m.taken, m.skipped) == (3, 0)


def test_a_recovery_abandons_the_exchange_drops_newer_snapshots_and_snapshots_at_the_next_commit() -> None:
    m, ex, live = manager(every=3)
    m.after_commit(1, vote_sum=1)
    ex.running = False
    m.after_commit(4, vote_sum=0)
    assert sorted(m.store.own) == [1, 4]
    m.abandon()
    assert ex.abandoned == 1
    m.after_recovery(1)  # rolled back to 1: the snapshot of 4 describes a recomputed future
    assert sorted(m.store.own) == [1]
    m.after_commit(2, vote_sum=1)
    assert [f.step for f in ex.started] == [1, 4, 2] and m.taken == 3


def test_every_below_zero_means_every_commit() -> None:
    m, ex, live = manager(every=-1)
    assert m.cadence.every == 1 and m.meter is None and m.vote_terms() == []


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def auto_manager(budget: float = 0.02) -> tuple[SnapshotManager, FakeExchanger, Clock]:
    ex, clock = FakeExchanger(), Clock()
    m = SnapshotManager(
        SnapshotStore(rank=0),
        ex,  # type: ignore[arg-type]
        AUTO_EVERY,
        lambda: ({"w": torch.zeros(4)}, {}),
        budget=budget,
        clock=clock,
    )
    return m, ex, clock


def commit(ms: list[SnapshotManager], step: int, exchanges: list[FakeExchanger]) -> None:
    """One committed step on every rank: the vote's sums, then each rank's after_commit."""
    terms = [m.vote_terms() for m in ms]
    sums = [sum(col) for col in zip(*terms, strict=True)]
    flag = sum(m.vote_flag() for m in ms)
    for m in ms:
        m.voted(sums)
    for m in ms:
        m.after_commit(step, vote_sum=flag)
    for ex in exchanges:
        ex.running = False  # every exchange is done by the next vote


def test_auto_measures_what_a_snapshot_costs_the_step_and_spaces_them_to_the_budget() -> None:
    m, ex, clock = auto_manager(budget=0.02)
    assert m.cadence.every == PROBE_EVERY and m.vote_terms() == vote_terms(PROBE_EVERY)
    started = len(ex.started)
    for step in range(1, 200):
        # a step takes 10 ms; the one after a snapshot's capture takes 5 ms more
        clock.now += 0.010 + (0.005 if len(ex.started) > started else 0.0)
        started = len(ex.started)
        commit([m], step, [ex])
    want = m.meter.want() if m.meter is not None else None
    assert want is not None and want.cost_s is not None and abs(want.cost_s - 0.005) < 1e-6
    assert want.step_s is not None and abs(want.step_s - 0.010) < 1e-6
    assert want.every == 32 == m.cadence.every  # 5 ms / (32 x 10 ms) < 2% <= 5 ms / (16 x 10 ms)
    steps = [f.step for f in ex.started]
    assert steps[-1] - steps[-2] == 32


def test_a_snapshot_that_costs_nothing_is_taken_every_step() -> None:
    m, ex, clock = auto_manager()
    for step in range(1, 120):
        clock.now += 0.010
        commit([m], step, [ex])
    assert m.cadence.every == 1
    steps = [f.step for f in ex.started]
    assert steps[-3:] == [117, 118, 119]


def test_a_spare_without_the_survivors_history_snapshots_the_same_steps() -> None:
    (a, ea, clock), (b, eb, _) = auto_manager(), auto_manager()
    b.clock = a.clock = clock
    for step in range(1, 100):  # `a` measured a cost: it asks for every 32 (as above)
        clock.now += 0.010 + (0.005 if a.cadence.pending == step - 1 else 0.0)
        commit([a], step, [ea])
    assert a.cadence.every == 32
    # A recovery at step 99: `b` is the spare (fresh: it asks for PROBE_EVERY until measured).
    for m in (a, b):
        m.after_recovery(99)
    for step in range(100, 300):
        clock.now += 0.010
        commit([a, b], step, [ea, eb])
        assert a.cadence.every == b.cadence.every  # agreed in the vote, whoever measured what
    assert [f.step for f in ea.started if f.step >= 100] == [f.step for f in eb.started]
    assert eb.started[0].step == 100  # both snapshot at the first commit after the recovery


def test_a_failed_exchange_votes_failed_and_the_next_snapshot_starts_instead_of_waiting_forever() -> None:
    m, ex, _ = manager(every=1)
    m.after_commit(1, vote_sum=1)  # snapshot of step 1 starts
    ex.running, ex.failed = False, "RuntimeError: peer timed out"
    assert m.vote_flag() == FAILED  # not "done": the copies never arrived
    m.after_commit(2, vote_sum=FAILED + 1)  # one rank failed, another was still running
    assert m.cadence.pending == 2 and [f.step for f in ex.started] == [1, 2]
    assert ex.failed is None
    assert 1 in m.store.own  # never confirmed, so nothing older was dropped on its account
