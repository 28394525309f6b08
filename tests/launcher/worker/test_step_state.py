"""The step's phases (step_state), the commit protocol's settling of an in-doubt
step (commit), a spare's wait for its ranks, and StableGroup's place in c10d's API."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from launcher.worker.commit import CommitProtocol
from launcher.worker.recovery import agree
from launcher.worker.replica_map import ReplicaMap, Transfer, plan_replay
from launcher.worker.spare.waiting import wait_for_ranks
from launcher.worker.stable_group import Interrupts, StableGroup
from launcher.worker.step_state import NONE, TRANSITIONS, Phase, ProtocolError, StepState
from resild.membership import Membership

pytestmark = pytest.mark.timeout(60)


def test_a_step_that_commits_goes_idle_synced_prepared_committed_and_on_to_the_next() -> None:
    st = StepState(step=4, committed_aux={"rng": "at 4"})
    st.mark_synced()
    assert st.synced and not st.prepared
    st.prepare({"rng": "at 5"}, found_inf=1)
    assert st.prepared and st.agreement_row()[:3] == (4, 1, 1)
    st.commit(0)
    assert (st.step, st.phase, st.last_found_inf, st.committed_aux) == (5, Phase.IDLE, 0, {"rng": "at 5"})
    assert st.prepared_aux is None and st.agreement_row()[:3] == (5, 0, 0)


def test_an_abandoned_step_keeps_the_last_commit() -> None:
    st = StepState(step=4, last_found_inf=1, committed_aux={"rng": "at 4"})
    st.mark_synced()
    st.prepare({"rng": "at 5"}, found_inf=0)
    st.abort()
    assert (st.step, st.phase, st.committed_aux, st.agreement_row()[:3]) == (4, Phase.IDLE, {"rng": "at 4"}, (4, 0, 1))


def test_transitions_outside_the_table_are_refused() -> None:
    st = StepState()
    with pytest.raises(ProtocolError):
        st.prepare({}, 0)  # a vote needs synced gradients
    st.mark_synced()
    with pytest.raises(ProtocolError):
        st.mark_synced()
    with pytest.raises(ProtocolError):
        st.commit(0)  # committing needs a vote
    assert all(Phase.IDLE in TRANSITIONS[p] or p in (Phase.SYNCED, Phase.PREPARED) for p in Phase)


def test_commit_once_per_step_bookkeeping() -> None:
    st = StepState(step=2)
    assert st.count_commit() is None  # outside `job.steps()` nothing is policed
    st.open_step()
    assert st.count_commit() is None
    assert st.count_commit() == 2  # the second commit in step 2
    assert st.close_step() == 2
    st.open_step()
    assert st.close_step() == 0


class _Train:
    """The TrainState calls the commit protocol makes, recorded."""

    device = None

    def __init__(self) -> None:
        self.applied: list[int] = []

    def apply_step(self, found_inf: int) -> None:
        self.applied.append(found_inf)


def _protocol(st: StepState, train: Any) -> CommitProtocol:
    return CommitProtocol(st, train, StableGroup("world", [0], 0, Interrupts()), Interrupts(), lambda: True)


def test_a_prepared_rank_rolls_forward_when_someone_committed_its_step() -> None:
    st, train = StepState(step=7), _Train()
    st.mark_synced()
    st.prepare({"rng": "at 8"}, found_inf=0)
    _protocol(st, train).settle(agree([[8, 0, 1], list(st.agreement_row())]), rank=1)
    assert train.applied == [1]  # the committed verdict, not the local one
    assert (st.step, st.phase, st.committed_aux, st.last_found_inf) == (8, Phase.IDLE, {"rng": "at 8"}, 1)


def test_a_prepared_rank_discards_its_step_when_nobody_committed() -> None:
    st, train = StepState(step=7, committed_aux={"rng": "at 7"}), _Train()
    st.mark_synced()
    st.prepare({"rng": "at 8"}, found_inf=0)
    _protocol(st, train).settle(agree([[7, 1, 0], list(st.agreement_row())]), rank=1)
    assert train.applied == []
    assert (st.step, st.phase, st.committed_aux) == (7, Phase.IDLE, {"rng": "at 7"})


def test_a_rank_whose_live_state_a_replay_will_write_holds_no_step_until_it_lands() -> None:
    st = StepState(step=5, committed_aux={"rng": "at 5"}, last_found_inf=0)
    live = {"model": {"w": "the parameters"}}

    class Train(_Train):
        def state_view(self, step: int) -> dict[str, Any]:
            return {"step": step, **live}

    assert _protocol(st, Train()).receive_into() == {"step": 5, **live}
    assert not st.holding and st.agreement_row()[:3] == (NONE, 0, -1)
    assert st.step == 5  # what its reports to the controller and node say (they take no negative step)
    # A cut-off replay's half-written rank is never a holder: the next agreement replays it
    # again from a real one, and a rollback never takes its live state for a snapshot's step.
    ag = agree([[9, 0, 0], list(st.agreement_row())])
    assert ag.target == 9 and ag.rollers == [] and ag.steps == [9, NONE]
    assert plan_replay(ag.steps, ReplicaMap.data_parallel(2), 1)[1] == [Transfer(0, 1, 0, 1)]
    st.replayed(9, {"rng": "at 9"})
    assert st.step == 9 and st.holding and st.agreement_row()[:3] == (9, 0, -1)
    st.mark_synced()
    with pytest.raises(ProtocolError, match="cannot be discarded"):
        st.discard()  # only between steps: a replay never runs inside one


class _Link:
    """A controller link whose pending membership is replaced by a newer one
    (leaving this spare out) between the spare's look and its take."""

    def __init__(self, first: Membership, second: Membership) -> None:
        self.shutdown = None
        self.pending: Membership | None = first
        self._queue = [second]
        self.cond = threading.Condition()

    def wait(self, pred: Any, timeout_s: float) -> bool:
        return bool(pred())

    def take(self) -> Membership | None:
        if self._queue:  # the control thread got a newer epoch just now
            self.pending = self._queue.pop(0)
        m, self.pending = self.pending, None
        return m


def _membership(epoch: int, nodes: dict[str, tuple[int, ...]]) -> Membership:
    return Membership(epoch, 2, nodes)


def test_a_spare_takes_its_rank_from_the_membership_it_took() -> None:
    # Epoch 2 gives the spare rank 1; epoch 3 (arriving as it looks) leaves it out;
    # epoch 4 gives it rank 1 again. It must never join with epoch 3 and no rank.
    link: Any = _Link(_membership(2, {"a": (0,), "spare": (1,)}), _membership(3, {"a": (0,), "b": (1,)}))
    link._queue.append(_membership(4, {"a": (0,), "spare": (1,)}))
    m, rank = wait_for_ranks(link, "spare", 0, lambda: None)
    assert (m.epoch, rank) == (4, 1)


def test_stable_group_keeps_process_group_name_a_method() -> None:
    # ProcessGroup.name() is torch's API (the backend's name); an attribute called
    # `name` on the group shadowed it: job.group.name() raised "'str' object is not callable".
    g = StableGroup("resild-shard-0", [0, 1], 1, Interrupts())
    assert g.name() == "resild"
    assert g.group_name == "resild-shard-0" and g.label == "resild-shard-0"
    assert (g.rank(), g.size()) == (1, 2)
