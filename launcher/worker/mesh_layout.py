"""The rank layout of an N-D device mesh over resild's groups (pure).

`job.mesh((2, 4), ("replicate", "shard"))` arranges ranks 0..W-1 row-major in
that shape, as `init_device_mesh` does. Each dimension gives every rank one
group: the ranks that differ from it only along that dimension. The replica
map follows from the names: ranks that agree on every coordinate but the
`replicate` one hold the same state; without a `replicate` dimension every rank
holds a state of its own (plain FSDP2, tensor parallelism), and recovery rolls
back to peer-memory snapshots instead of replaying from a replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.worker.replica_map import ReplicaMap

REPLICATE = "replicate"


class MeshError(ValueError):
    """A mesh that does not fit the job: the message names the fix."""


@dataclass(frozen=True)
class MeshLayout:
    shape: tuple[int, ...]
    names: tuple[str, ...]

    @staticmethod
    def build(world_size: int, shape: tuple[int, ...] | list[int], names: tuple[str, ...] | list[str]) -> MeshLayout:
        """Validate `shape` and `names`; one -1 in `shape` takes what is left of the world."""
        shape, names = tuple(int(s) for s in shape), tuple(str(n) for n in names)
        if not shape or len(shape) != len(names):
            raise MeshError(f"mesh: {len(shape)} dimension size(s) but {len(names)} name(s) {list(names)}")
        if len(set(names)) != len(names) or any(not n for n in names):
            raise MeshError(f"mesh: dimension names must be distinct and non-empty, not {list(names)}")
        if shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
            raise MeshError(f"mesh: sizes must be positive (one may be -1 for 'the rest'), not {list(shape)}")
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            if world_size % known:
                raise MeshError(f"mesh {list(shape)}: world size {world_size} is not a multiple of {known}")
            shape = tuple(world_size // known if s == -1 else s for s in shape)
        if math.prod(shape) != world_size:
            raise MeshError(f"mesh {dict(zip(names, shape))} holds {math.prod(shape)} ranks, the job has {world_size}")
        return MeshLayout(shape, names)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            rank, c = divmod(rank, size)
            out.append(c)
        return tuple(reversed(out))

    def rank_at(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, size in zip(coords, self.shape):
            r = r * size + c
        return r

    def group(self, dim: int, rank: int) -> tuple[str, list[int]]:
        """(label, ranks) of `rank`'s group along `dim`. The label names the coset by the
        other coordinates, so every member computes the same one."""
        c = list(self.coords(rank))
        others = [x for i, x in enumerate(c) if i != dim]
        other_sizes = [s for i, s in enumerate(self.shape) if i != dim]
        idx = 0
        for x, s in zip(others, other_sizes):
            idx = idx * s + x
        ranks = []
        for k in range(self.shape[dim]):
            c[dim] = k
            ranks.append(self.rank_at(tuple(c)))
        return f"resild-{self.names[dim]}-{idx}", ranks

    def replicas(self) -> ReplicaMap:
        """Ranks equal on every coordinate but `replicate` hold the same state."""
        if REPLICATE not in self.names:
            return ReplicaMap(tuple((r,) for r in range(self.world_size)))
        dim = self.names.index(REPLICATE)
        seen: dict[int, tuple[int, ...]] = {}
        for r in range(self.world_size):
            _, ranks = self.group(dim, r)
            seen.setdefault(min(ranks), tuple(ranks))
        return ReplicaMap(tuple(seen[k] for k in sorted(seen)))

    @property
    def replica_ranks(self) -> int:
        """Ranks in one replica group (every coordinate but `replicate`): a node's unit of loss."""
        return (
            self.world_size // self.shape[self.names.index(REPLICATE)] if REPLICATE in self.names else self.world_size
        )

    def resize_refusal(self, per_node: int) -> str | None:
        """Why a job on this mesh cannot shrink by whole nodes (None: it can). Dropping a node
        must drop whole replica groups and leave every other rank's coordinates as they were."""
        if REPLICATE not in self.names:
            return "its mesh has no 'replicate' dimension (one copy of each shard: plain FSDP2, TP)"
        if self.names[0] != REPLICATE:
            return "its 'replicate' dimension is not the outermost (a replica group must be consecutive ranks)"
        if per_node % self.replica_ranks:
            return f"a replica group ({self.replica_ranks} ranks) does not fit whole on a node ({per_node} ranks)"
        return None

    def resized(self, world_size: int) -> MeshLayout:
        """The same mesh over `world_size` ranks: the `replicate` dimension takes the change."""
        shape = [-1 if n == REPLICATE else s for s, n in zip(self.shape, self.names)]
        return MeshLayout.build(world_size, shape, self.names)

    @property
    def has_replicas(self) -> bool:
        return REPLICATE in self.names and self.shape[self.names.index(REPLICATE)] > 1
