"""When a disk checkpoint starts (pure policy)."""

from __future__ import annotations

from launcher.worker.redundancy.checkpoint_cadence import BROKEN, Action, CheckpointCadence, flag


def test_a_due_checkpoint_starts_when_no_rank_is_writing() -> None:
    c = CheckpointCadence(every=10)
    assert [c.on_commit(s, 0).action for s in (9, 10, 11, 20)] == [Action.NONE, Action.SAVE, Action.NONE, Action.SAVE]


def test_a_busy_writer_defers_the_due_checkpoint_to_the_first_idle_commit_reported_once() -> None:
    c = CheckpointCadence(every=10)
    d = c.on_commit(10, 2)
    assert d.action is Action.DEFER and d.first and "2 rank(s) still writing" in d.reason
    d = c.on_commit(11, 1)
    assert d.action is Action.DEFER and not d.first  # said once per pending checkpoint
    assert c.on_commit(12, 0).action is Action.SAVE  # step 12: the state now, not step 10's
    assert c.on_commit(13, 0).action is Action.NONE
    assert c.on_commit(20, 1).first  # the next pending one is reported again


def test_a_broken_checkpoint_group_turns_checkpoints_off_until_a_recovery() -> None:
    c = CheckpointCadence(every=5)
    assert flag(busy=True, broken=False) == 1 and flag(busy=False, broken=True) == BROKEN
    d = c.on_commit(5, BROKEN + 3)
    assert d.action is Action.OFF and "off until the next" in d.reason
    c.after_recovery()
    assert c.pending is None and c.on_commit(6, 0).action is Action.NONE
    assert c.on_commit(10, 0).action is Action.SAVE


def test_a_recovery_forgets_a_deferred_checkpoint_so_a_fresh_spare_decides_alike() -> None:
    survivor, spare = CheckpointCadence(every=10), CheckpointCadence(every=10)
    survivor.on_commit(10, 1)
    survivor.after_recovery()
    for s in (11, 19, 20):
        assert survivor.on_commit(s, 0) == spare.on_commit(s, 0)
