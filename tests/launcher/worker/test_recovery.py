"""RecoverySequence's replay of a source prepared while the groups formed: sent only while
the state is what was prepared (pure, with a recording transport in place of the wire)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from launcher.worker import recovery
from launcher.worker.recovery import RecoverySequence
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup
from tests.launcher.worker.test_collective_reads import _NcclInner as _World  # collectives that complete at once

pytestmark = pytest.mark.timeout(30)


class _Transport:
    """Records what each exchange was given; sends nothing."""

    calls: list[dict[str, Any]] = []

    def __init__(self, pg: Any, device: torch.device, wait: Any, *rest: Any) -> None:
        pass

    def exchange(self, plan: Any, me: int, snapshot: Any, receive_into: Any = None, prepared: Any = None) -> None:
        self.calls.append({"me": me, "prepared": prepared, "sources": [t.src for t in plan]})


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> RecoverySequence:
    monkeypatch.setattr(recovery, "P2PTransport", _Transport)
    _Transport.calls = []
    intr = Interrupts()
    r = RecoverySequence(intr, GroupFactory("gloo", lambda: None, 10.0), torch.device("cpu"), bury_s=0.0)
    world = StableGroup("world", [0, 1], 0, intr)
    world.set_backend(_World())
    r.groups["world"] = world
    return r


def _state() -> tuple[dict[str, Any], dict[str, Any]]:
    return {"w": torch.ones(4, 3), "b": torch.zeros(3), "step": 5}, {"rng": torch.zeros(8, dtype=torch.uint8)}


def _replay(rec: RecoverySequence, state: Any, rank: int = 0) -> Any:
    rec.replay([8, 7], ReplicaMap.data_parallel(2), rank, 1, lambda: state)  # rank 1 is behind: 0 sends
    return _Transport.calls[-1]["prepared"]


def test_a_source_prepared_while_the_groups_formed_is_sent_as_prepared(rec: RecoverySequence) -> None:
    state = _state()
    rec.prepare_source(lambda: state, lambda: 1)
    prepared = _replay(rec, state)
    assert prepared is not None and rec.prepared_used == 1
    assert prepared.packed().numel() > 0  # packed while the groups formed, in host memory
    assert _replay(rec, state) is None  # used once: the next replay walks the state again


@pytest.mark.parametrize(
    "change",
    [
        lambda s, token: s[0]["w"].add_(1),  # written in place (a roll forward's optimizer step)
        lambda s, token: s[0]["b"].copy_(torch.ones(3)),  # copied into (a rollback's restore)
        lambda s, token: token.append(1),  # the step, the committed aux or a restore moved on
    ],
)
def test_a_state_changed_since_it_was_prepared_is_walked_again(rec: RecoverySequence, change: Any) -> None:
    state, token = _state(), [0]
    rec.prepare_source(lambda: state, lambda: len(token))
    change(state, token)
    assert _replay(rec, state) is None and rec.prepared_used == 0


def test_what_an_optimizer_step_writes_is_seen_as_a_change(rec: RecoverySequence) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()

    def view() -> tuple[dict[str, Any], dict[str, Any]]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}, {}

    rec.prepare_source(view, lambda: 1)
    assert rec._prepared is not None and rec._prepared.unchanged()
    opt.step()  # foreach updates of the parameters, moments and step counters
    assert _replay(rec, view()) is None


def test_a_rank_that_does_not_send_drops_what_it_prepared(rec: RecoverySequence) -> None:
    state = _state()
    rec.prepare_source(lambda: state, lambda: 1)
    assert _replay(rec, state, rank=1) is None and rec._prepared is None  # the receiver


def test_a_retired_epoch_or_a_finished_join_drops_what_was_prepared(rec: RecoverySequence) -> None:
    state = _state()
    rec.prepare_source(lambda: state, lambda: 1)
    rec.retire()
    assert rec._prepared is None
    rec.groups["world"].set_backend(_World())  # the next epoch's
    rec.prepare_source(lambda: state, lambda: 1)
    rec.forget_prepared()
    assert _replay(rec, state) is None


def test_a_state_that_cannot_be_prepared_leaves_the_replay_to_take_it(rec: RecoverySequence) -> None:
    with torch.inference_mode():
        frozen = torch.ones(3)  # keeps no version: whether it changed cannot be told
    rec.prepare_source(lambda: ({"w": frozen}, {}), lambda: 1)
    assert rec._prepared is None
    rec.prepare_source(lambda: ({"w": object()}, {}), lambda: 1)  # not a state resild replays
    assert _replay(rec, _state()) is None and _Transport.calls[-1]["sources"] == [0]


def test_a_gpu_replay_prepares_nothing_ahead() -> None:
    rec = RecoverySequence(Interrupts(), GroupFactory("nccl", lambda: None, 10.0), torch.device("cuda"), bury_s=0.0)
    taken: list[int] = []
    rec.prepare_source(lambda: (taken.append(1), _state())[1], lambda: 1)  # would sync behind the old kernels
    assert rec._prepared is None and taken == []


def test_forming_runs_the_preparation_while_the_groups_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    intr = Interrupts()
    rec = RecoverySequence(intr, GroupFactory("gloo", lambda: None, 10.0), torch.device("cpu"), bury_s=0.0)
    order: list[str] = []

    def build(epoch: int, g: StableGroup) -> Any:
        order.append("built")
        return _World()

    monkeypatch.setattr(rec.factory, "build", build)
    world = StableGroup("world", [0, 1], 0, intr)
    rec.form(2, [world], lambda: order.append("meanwhile"))
    assert sorted(order) == ["built", "meanwhile"] and world.pg is not None
