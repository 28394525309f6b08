"""After-commit hooks (launcher.worker.commit.CommitHook): each hook's flag rides in the
step's one vote, hooks run in registration order after the step is applied, and a hook
that finds the state unfit stops the ones after it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from launcher.worker.commit import CommitProtocol
from launcher.worker.stable_group import Interrupts
from launcher.worker.step_state import StepState

pytestmark = pytest.mark.timeout(30)


class _Done:
    def wait(self) -> None:
        pass


class _TwoRanks:
    """The vote's all-reduce as if a second rank voted exactly like this one."""

    def __init__(self) -> None:
        self.votes: list[list[int]] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> _Done:
        self.votes.append(tensors[0].tolist())
        tensors[0].mul_(2)
        return _Done()


class _Train:
    device = torch.device("cpu")

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def local_found_inf(self) -> int:
        return 0

    def capture_aux(self) -> dict[str, Any]:
        return {}

    def apply_step(self, found_inf: int) -> None:
        self.log.append("apply")


class _Hook:
    def __init__(self, name: str, flag: int, keep: bool, log: list[str]) -> None:
        self.name, self.flag, self.keep, self.log = name, flag, keep, log

    def vote_flag(self) -> int:
        return self.flag

    def before_write(self) -> None:
        self.log.append(f"{self.name}.before_write")

    def after_commit(self, step: int, vote_sum: int) -> bool:
        self.log.append(f"{self.name}.after_commit({step}, {vote_sum})")
        return self.keep


def _protocol(log: list[str], group: _TwoRanks) -> CommitProtocol:
    steps = StepState(step=4, committed_aux={}, last_found_inf=0)
    steps.open_step()
    p = CommitProtocol(steps, _Train(log), group, Interrupts(), lambda: False)  # type: ignore[arg-type]
    p.steps.mark_synced()  # gradients synced by the model's own hooks
    return p


def test_hooks_vote_then_run_in_order_after_the_step_is_applied() -> None:
    log: list[str] = []
    group = _TwoRanks()
    p = _protocol(log, group)
    p.hooks += [_Hook("snap", 1, True, log), _Hook("ckpt", 3, True, log)]
    assert p.vote()
    assert group.votes == [[0, 1, 3]]  # [found_inf, snap's flag, ckpt's flag]: one all-reduce
    assert log == [
        "snap.before_write",
        "ckpt.before_write",
        "apply",
        "snap.after_commit(5, 2)",  # each hook gets its own column's sum over the ranks
        "ckpt.after_commit(5, 6)",
    ]


def test_a_hook_that_finds_the_state_unfit_stops_the_hooks_after_it() -> None:
    log: list[str] = []
    p = _protocol(log, _TwoRanks())
    p.hooks += [_Hook("fingerprint", 0, False, log), _Hook("ckpt", 0, True, log)]
    assert p.vote()
    assert "fingerprint.after_commit(5, 0)" in log and not any(e.startswith("ckpt.after") for e in log)


def test_the_commit_protocol_imports_no_redundancy() -> None:
    import launcher.worker.commit as commit

    src = open(commit.__file__).read()
    assert "redundancy" not in "".join(line for line in src.splitlines() if line.startswith(("from ", "import ")))
