"""Membership: which node holds which ranks in which epoch, and node roles.

NodeRole transitions (anything else is a bug and raises):

    SPARE  -> ACTIVE   (assigned a failed node's ranks)
    SPARE  -> FENCED   (a spare that failed is dropped from the pool)
    ACTIVE -> FENCED   (failed: killed, drained, never rejoins)
    ACTIVE -> DONE, SPARE -> DONE   (job finished)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class NodeRole(str, Enum):
    ACTIVE = "active"
    SPARE = "spare"
    FENCED = "fenced"
    DONE = "done"


ROLE_TRANSITIONS: dict[NodeRole, frozenset[NodeRole]] = {
    NodeRole.SPARE: frozenset({NodeRole.ACTIVE, NodeRole.FENCED, NodeRole.DONE}),
    NodeRole.ACTIVE: frozenset({NodeRole.FENCED, NodeRole.DONE}),
    NodeRole.FENCED: frozenset(),
    NodeRole.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: NodeRole, new: NodeRole) -> None:
    if new not in ROLE_TRANSITIONS[old]:
        raise IllegalTransition(f"node role {old.value} -> {new.value} is not allowed")


@dataclass(frozen=True)
class Membership:
    """The rank layout of one epoch. Ranks of a node are ordered by local rank."""

    epoch: int
    world_size: int
    node_ranks: dict[str, tuple[int, ...]]

    def rank_of(self, node: str, local_rank: int) -> int | None:
        ranks = self.node_ranks.get(node)
        if ranks is None or local_rank >= len(ranks):
            return None
        return ranks[local_rank]

    def node_of(self, rank: int) -> str | None:
        for node, ranks in self.node_ranks.items():
            if rank in ranks:
                return node
        return None

    def bump(self) -> Membership:
        """The next epoch with the same layout: re-form without replacing anyone."""
        return Membership(self.epoch + 1, self.world_size, dict(self.node_ranks))

    def replace(self, failed: str, spare: str) -> Membership:
        """The next epoch: `spare` takes exactly the ranks `failed` held."""
        if failed not in self.node_ranks:
            raise KeyError(f"{failed} holds no ranks in epoch {self.epoch}")
        if spare in self.node_ranks:
            raise ValueError(f"{spare} already holds ranks in epoch {self.epoch}")
        layout = {(spare if n == failed else n): r for n, r in self.node_ranks.items()}
        return Membership(self.epoch + 1, self.world_size, layout)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "world_size": self.world_size,
                "node_ranks": {n: list(r) for n, r in self.node_ranks.items()}}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Membership:
        return Membership(int(d["epoch"]), int(d["world_size"]),
                          {str(n): tuple(int(x) for x in r) for n, r in d["node_ranks"].items()})

    @staticmethod
    def initial(active_nodes: list[str], nproc_per_node: int) -> Membership:
        layout = {n: tuple(range(i * nproc_per_node, (i + 1) * nproc_per_node)) for i, n in enumerate(active_nodes)}
        return Membership(1, len(active_nodes) * nproc_per_node, layout)


@dataclass
class NodeView:
    node_id: str
    role: NodeRole
    nproc: int
    registered: bool = False
    last_heartbeat_s: float = 0.0
    workers_ready: int = 0  # workers registered and waiting/training
    reason: str = ""
    host_pid: int | None = None
    health: str = "healthy"

    def set_role(self, role: NodeRole, reason: str = "") -> None:
        check_transition(self.role, role)
        self.role = role
        if reason:
            self.reason = reason


@dataclass
class RankProgress:
    step: int = 0
    epoch: int = 0
    state: str = "compute"  # "compute" | "wait" (blocked in a collective or group formation)
    t_s: float = 0.0        # controller-side monotonic time of the last report


@dataclass
class ClusterView:
    """What the policy sees. Built and mutated by the controller only."""

    nodes: dict[str, NodeView]
    membership: Membership | None = None
    epoch_started_s: float = 0.0
    last_commit_s: float = 0.0
    progress: dict[int, RankProgress] = field(default_factory=dict)
    done_ranks: set[int] = field(default_factory=set)
    first_done_s: float | None = None  # when the first rank of this epoch reported done
    probe_sent_s: float | None = None  # a liveness probe is out since then (see policy.check_probe)
    probe_targets: frozenset[str] = frozenset()  # the nodes it was sent to
    probe_epoch: int = 0                         # the epoch whose collective failed
    exceptions_seen: list[str] = field(default_factory=list)  # worker exception texts, oldest first

    def spares(self) -> list[NodeView]:
        return [n for n in self.nodes.values() if n.role == NodeRole.SPARE]
