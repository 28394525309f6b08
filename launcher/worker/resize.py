"""Shrink and grow (--min-replicas): a job's width as this process sees it change.

The controller shrinks a job by whole nodes when no spare is left and grows it back when
one comes. What stays the same across widths lives here: the job's full width (its data
shards), whether its layout can change width at all, the names its groups take at each
width, and the loop's callbacks told of a resize. Re-making the job's groups at a new
width is the job's own wiring (runtime.Job._resize).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from launcher.worker.mesh_layout import MeshLayout


@dataclass
class Resizer:
    full_world_size: int = 1  # the job's width with every node it started with
    widths: int = 0  # how many times this process re-made its groups at another width
    # A resize: groups made now are formed with the epoch's, not one by one.
    forming_deferred: bool = False
    callbacks: list[Callable[[int, int], None]] = field(default_factory=list)

    def name(self, label: str) -> str:
        """A group's c10d name: unique in this process, so each width's names are new (the
        ranks meet under the plain `label`, as a newcomer names it)."""
        return f"{label}~{self.widths}" if self.widths else label

    def data_shards(self, rank: int, world_size: int) -> list[int]:
        """The full width's shards `rank` computes at `world_size`: its own, then the missing
        ranks' shards round-robin."""
        return list(range(rank, self.full_world_size, world_size))

    def shard_weight(self, world_size: int) -> float:
        return world_size / self.full_world_size

    @staticmethod
    def refusal(own_replicas: bool, layout: MeshLayout | None, per_node: int) -> str | None:
        """Why a job cannot change width by whole nodes (None: it can): a node must hold
        whole replica groups (data parallel: every rank is one; HSDP: a replicate group).
        `own_replicas`: the job gave its own replica map."""
        if own_replicas:
            return "it gives its own replica map (shrinking needs job.mesh()'s or plain data parallelism)"
        if layout is not None:
            return layout.resize_refusal(per_node)
        return None

    @staticmethod
    def replica_ranks(layout: MeshLayout | None) -> int:
        """Ranks in one replica group: the unit the controller counts replicas in."""
        return layout.replica_ranks if layout is not None else 1

    def resized(self, rank: int, old: int, new: int) -> None:
        """The recovery into another width is complete: say it, then the loop's callbacks."""
        if rank == 0:
            sys.stderr.write(f"resild: the job {'shrank' if new < old else 'grew'} from {old} to {new} ranks\n")
        for cb in self.callbacks:
            cb(old, new)
