"""ReplicaSource: what it makes ready while a recovery's groups form (pure, with a
recording recovery sequence)."""

from __future__ import annotations

from typing import Any

import pytest

from launcher.worker.replica_map import ReplicaMap
from launcher.worker.sources.context import SourceContext
from launcher.worker.sources.replica import ReplicaSource
from launcher.worker.step_state import StepState

pytestmark = pytest.mark.timeout(30)


class _Rec:
    def __init__(self) -> None:
        self.prepared: list[Any] = []

    def prepare_source(self, snapshot: Any, token: Any) -> None:
        self.prepared.append((snapshot, token))


class _Protocol:
    def __init__(self, steps: StepState) -> None:
        self.steps = steps

    def replica_state(self) -> Any:
        return {}, {}

    def replica_token(self) -> Any:
        return 1


def _source(rank: int, replicas: ReplicaMap, steps: StepState) -> tuple[ReplicaSource, _Rec, _Protocol]:
    rec, protocol = _Rec(), _Protocol(steps)
    ctx = SourceContext(rank, 4, rec, protocol, lambda: replicas, 1, None, print, exit)  # type: ignore[arg-type]
    return ReplicaSource(ctx), rec, protocol


def test_a_survivor_with_a_replica_prepares_what_it_would_send() -> None:
    steps = StepState()
    steps.step = 12
    src, rec, protocol = _source(1, ReplicaMap.hsdp(4, 2), steps)  # rank 1 holds shard 1 with rank 3
    src.ahead()
    assert rec.prepared == [(protocol.replica_state, protocol.replica_token)]


@pytest.mark.parametrize(
    ("replicas", "holding", "step"),
    [
        (ReplicaMap(((0,), (1,), (2,), (3,))), True, 12),  # nobody holds a copy of its shard: it never sends
        (ReplicaMap.data_parallel(4), False, 12),  # a replay half wrote its state: it holds no step
        (ReplicaMap.data_parallel(4), True, -1),  # no step at all
    ],
)
def test_a_rank_that_cannot_send_prepares_nothing(replicas: ReplicaMap, holding: bool, step: int) -> None:
    steps = StepState()
    steps.step, steps.holding = step, holding
    src, rec, _ = _source(1, replicas, steps)
    src.ahead()
    assert rec.prepared == []
