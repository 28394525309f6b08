"""What the restore sources are built from: the worker's parts they read, named once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from launcher.worker.commit import CommitProtocol
    from launcher.worker.recovery import RecoverySequence
    from launcher.worker.redundancy.coordinator import Redundancy
    from launcher.worker.replica_map import ReplicaMap


@dataclass(frozen=True)
class SourceContext:
    rank: int
    world_size: int
    rec: RecoverySequence  # the job's groups and collectives of the recovery
    protocol: CommitProtocol  # the live state: what a replica sends, where a receiver writes
    replicas: Callable[[], ReplicaMap]
    max_sources: int  # replay: holders a receiver pulls slices from at once
    redundancy: Redundancy | None  # snapshots and disk checkpoints, when the job keeps them
    emit: Callable[..., Any]  # an event (EventName, fields)
    fatal: Callable[[str], NoReturn]  # stop the job with one line (every rank computes the same)
