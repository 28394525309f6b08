"""Which ranks hold identical state (the replica map), and who sends to whom.

Plain data parallelism: one replica group of all ranks. HSDP with shard size S:
rank r holds shard r % S; its replicas are the ranks with the same r % S.
"""

from __future__ import annotations

from dataclasses import dataclass


class NoReplica(RuntimeError):
    """Every holder of some shard at the agreed step is gone: checkpointless recovery is impossible."""


@dataclass(frozen=True)
class ReplicaMap:
    groups: tuple[tuple[int, ...], ...]  # each group: ranks holding identical state

    def validate(self, world_size: int) -> None:
        """The groups must partition range(world_size): a rank in no group would
        silently resume from nothing, a rank in two would get two states."""
        seen = sorted(r for g in self.groups for r in g)
        if seen != list(range(world_size)):
            raise ValueError(
                f"replica map {[list(g) for g in self.groups]} does not partition ranks "
                f"0..{world_size - 1}: every rank must be in exactly one replica group"
            )

    @staticmethod
    def data_parallel(world_size: int) -> ReplicaMap:
        return ReplicaMap((tuple(range(world_size)),))

    @staticmethod
    def hsdp(world_size: int, shard_size: int) -> ReplicaMap:
        if shard_size <= 0 or world_size % shard_size:
            raise ValueError(f"world size {world_size} is not a multiple of shard size {shard_size}")
        return ReplicaMap(tuple(tuple(range(s, world_size, shard_size)) for s in range(shard_size)))


@dataclass(frozen=True)
class Transfer:
    """`src` sends `dst` slice `part` of `parts` of the replicated state; the
    source of part 0 also sends the skeleton and the aux state (RNG, extra)."""

    src: int
    dst: int
    part: int = 0
    parts: int = 1


def plan_replay(steps: list[int], replicas: ReplicaMap, max_sources: int = 1) -> tuple[int, list[Transfer]]:
    """Agree on the newest committed step and plan who sends state to each rank behind it.

    A step commits only when every rank's all-reduce completed, so the newest
    step any rank holds is a valid state for the whole group. Sources are spread
    round-robin over the holders so several receivers do not queue on one rank;
    with `max_sources` > 1 a receiver pulls disjoint slices from up to that many
    holders at once.
    """
    target = max(steps)
    plan: list[Transfer] = []
    for group in replicas.groups:
        holders = [r for r in group if steps[r] == target]
        behind = [r for r in group if steps[r] != target]
        if behind and not holders:
            raise NoReplica(
                f"no rank of replica group {list(group)} holds step {target}: "
                "checkpointless recovery is impossible; restart from a disk checkpoint"
            )
        k = max(1, min(max_sources, len(holders)))
        for i, dst in enumerate(behind):
            plan += [Transfer(holders[(i * k + j) % len(holders)], dst, j, k) for j in range(k)]
    return target, plan


def slice_bounds(nbytes: int, part: int, parts: int) -> tuple[int, int]:
    """Byte range of slice `part`; sender and receiver compute the same one."""
    return nbytes * part // parts, nbytes * (part + 1) // parts
