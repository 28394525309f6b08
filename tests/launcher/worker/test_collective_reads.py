"""On NCCL a collective's `wait()` only orders streams: reading its result is what blocks,
and an aborted collective releases that read with garbage. The epoch's error is latched
before the abort, so every read of a control collective checks it *after* reading.
Here a read that latches the error while it runs stands in for the abort."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from launcher.worker.commit import CommitProtocol
from launcher.worker.recovery import RecoverySequence, Reformed
from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup
from launcher.worker.step_state import Phase, StepState
from launcher.worker.train_state import TrainState

pytestmark = pytest.mark.timeout(30)


class _StreamWork:
    """What an NCCL work's wait() does on the CPU: nothing."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Group:
    def allreduce(self, tensors: list[torch.Tensor]) -> _StreamWork:
        return _StreamWork()

    def size(self) -> int:
        return 2


def _abort_during_reads(monkeypatch: pytest.MonkeyPatch, intr: Interrupts, garbage: Any) -> None:
    def read(self: torch.Tensor) -> Any:
        intr.fail("peer lost: communicator aborted")
        return garbage

    monkeypatch.setattr(torch.Tensor, "tolist", read)


def test_an_aborted_vote_commits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    intr = Interrupts()
    model = torch.nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    steps = StepState()
    protocol = CommitProtocol(
        steps,
        TrainState(model, torch.optim.SGD(model.parameters(), lr=0.5)),
        _Group(),  # type: ignore[arg-type]
        intr,
        lambda: intr.error is not None,
    )
    _abort_during_reads(monkeypatch, intr, [7, 0, 0])  # garbage that would read as "inf seen"
    assert protocol.vote() is False
    assert steps.phase is Phase.PREPARED and steps.step == 0  # in doubt; the recovery decides
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class _NcclInner(_Group):
    def name(self) -> str:
        return "nccl"


def test_an_aborted_agreement_restarts_the_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    intr = Interrupts()
    rec = RecoverySequence(intr, GroupFactory("gloo", lambda: None, 10.0), torch.device("cpu"), bury_s=0.0)
    world = StableGroup("world", [0, 1], 0, intr)
    world.set_backend(_NcclInner())
    rec.groups["world"] = world
    _abort_during_reads(monkeypatch, intr, [[99, 1, 0], [0, 0, -1]])  # would agree on step 99
    with pytest.raises(Reformed, match="aborted"):
        rec.agree(0, 2, (5, 0, 0))
