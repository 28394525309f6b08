"""Membership: which node holds which ranks in which epoch, and node roles.

NodeRole transitions (anything else is a bug and raises):

    SPARE  -> ACTIVE   (assigned a failed node's ranks, or new ranks when a shrunk job grows)
    SPARE  -> FENCED   (a spare that failed is dropped from the pool)
    ACTIVE -> FENCED   (failed: killed, drained, never rejoins)
    ACTIVE -> DONE, SPARE -> DONE   (job finished)
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any


class NodeRole(str, Enum):
    ACTIVE = "active"
    SPARE = "spare"
    FENCED = "fenced"
    DONE = "done"


ROLE_TRANSITIONS: dict[NodeRole, frozenset[NodeRole]] = {
    NodeRole.SPARE: frozenset({NodeRole.ACTIVE, NodeRole.FENCED, NodeRole.DONE}),
    NodeRole.ACTIVE: frozenset({NodeRole.FENCED, NodeRole.DONE}),
    # only re-admission (resild.controller.readmission): a suspect node, its old incarnation gone
    NodeRole.FENCED: frozenset({NodeRole.SPARE}),
    NodeRole.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: NodeRole, new: NodeRole) -> None:
    if new not in ROLE_TRANSITIONS[old]:
        raise IllegalTransition(f"node role {old.value} -> {new.value} is not allowed")


class DeltaMismatch(ValueError):
    """A delta that does not apply to the layout held: the receiver needs the full layout."""


MAX_STEP = (1 << 53) - 1  # a step stays exact in every peer's JSON parser up to here


def _step(raw: Any) -> int:
    """A committed step from the wire: an integer in [0, MAX_STEP]; absent is 0 (no floor)."""
    if raw is None:
        return 0
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= MAX_STEP:
        raise ValueError(f"committed must be an integer in [0, {MAX_STEP}], not {raw!r}")
    return raw


@dataclass(frozen=True)
class Membership:
    """The rank layout of one epoch. Ranks of a node are ordered by local rank.

    On the wire, to node processes: one delta frame (`delta_from`, MEMBERSHIP_DELTA)
    for every node holding the previous epoch, and to the others their node's view
    (`view`, MEMBERSHIP: its own ranks and the world size, all a worker needs). Each
    is ~100 bytes; sending the full layout (~100 KB at 16k ranks) to every node
    would make an epoch cost O(nodes x ranks): 200 MB at 2,000 nodes for epoch 1.
    A view is "partial": it names fewer ranks than world_size.

    `committed` is the committed floor: the newest step the controller knew committed
    when it decided this epoch. A recovery into this epoch that finds no rank at that
    step has lost every replica of the state: it must stop, not restart from older
    state. It travels with the epoch (view, delta, relayed layout) from the controller,
    which is authenticated, never through a store key.
    """

    epoch: int
    world_size: int
    node_ranks: dict[str, tuple[int, ...]]
    committed: int = 0
    # (the membership it was made from, {old node: new node}) when made by replace() or
    # bump(): a delta from that very object is then O(moves), not O(nodes). Weak: an
    # epoch must not keep every earlier one alive. Not on the wire.
    _made_from: tuple[weakref.ref[Membership], dict[str, str]] | None = field(default=None, compare=False, repr=False)

    @cached_property
    def _rank_node(self) -> dict[int, str]:
        # Built once per epoch (O(ranks)); makes node_of O(1) for the hang detector.
        return {r: n for n, ranks in self.node_ranks.items() for r in ranks}

    def rank_of(self, node: str, local_rank: int) -> int | None:
        ranks = self.node_ranks.get(node)
        if ranks is None or local_rank >= len(ranks):
            return None
        return ranks[local_rank]

    def node_of(self, rank: int) -> str | None:
        return self._rank_node.get(rank)

    @property
    def partial(self) -> bool:
        return len(self._rank_node) < self.world_size

    def view(self, node: str) -> Membership:
        """What `node` needs of this epoch: its own ranks (none if it holds none), the world
        size, the committed floor."""
        ranks = self.node_ranks.get(node)
        return Membership(self.epoch, self.world_size, {node: ranks} if ranks is not None else {}, self.committed)

    def with_committed(self, step: int) -> Membership:
        """This epoch with the committed floor the controller decided it at."""
        return dataclasses.replace(self, committed=_step(step))

    def bump(self) -> Membership:
        """The next epoch with the same layout: re-form without replacing anyone."""
        return Membership(
            self.epoch + 1, self.world_size, dict(self.node_ranks), self.committed, (weakref.ref(self), {})
        )

    def replace(self, failed: str, spare: str, *, next_epoch: bool = True) -> Membership:
        """The next epoch: `spare` takes exactly the ranks `failed` held. Before the
        first epoch was announced (`next_epoch=False`) the layout changes in place."""
        if failed not in self.node_ranks:
            raise KeyError(f"{failed} holds no ranks in epoch {self.epoch}")
        if spare in self.node_ranks:
            raise ValueError(f"{spare} already holds ranks in epoch {self.epoch}")
        layout = {(spare if n == failed else n): r for n, r in self.node_ranks.items()}
        if not next_epoch:
            return Membership(self.epoch, self.world_size, layout, self.committed)
        return Membership(self.epoch + 1, self.world_size, layout, self.committed, (weakref.ref(self), {failed: spare}))

    def shrink(self, failed: str) -> Membership:
        """The next epoch without `failed` (no spare was left): the survivors keep their
        order and are renumbered 0..W'-1, each node's ranks still consecutive. Only for
        jobs whose every rank is a replica of the state (data parallel), where dropping
        any node leaves every shard held."""
        if failed not in self.node_ranks:
            raise KeyError(f"{failed} holds no ranks in epoch {self.epoch}")
        order = sorted((r[0] if r else 0, n) for n, r in self.node_ranks.items() if n != failed)
        layout: dict[str, tuple[int, ...]] = {}
        nxt = 0
        for _, n in order:
            k = len(self.node_ranks[n])
            layout[n] = tuple(range(nxt, nxt + k))
            nxt += k
        return Membership(self.epoch + 1, nxt, layout, self.committed)

    def grow(self, spare: str, nproc: int) -> Membership:
        """The next epoch with `spare` holding `nproc` new ranks after the last one."""
        if spare in self.node_ranks:
            raise ValueError(f"{spare} already holds ranks in epoch {self.epoch}")
        if nproc <= 0:
            raise ValueError(f"a node holds at least one rank, not {nproc}")
        layout = dict(self.node_ranks)
        layout[spare] = tuple(range(self.world_size, self.world_size + nproc))
        return Membership(self.epoch + 1, self.world_size + nproc, layout, self.committed)

    # ---- deltas: what changed from the previous epoch ------------------------
    def delta_from(self, prev: Membership) -> dict[str, Any] | None:
        """The change from `prev` as {epoch, base, world_size, moves: {old node: new node},
        committed}, or None when this epoch is not a pure renaming of `prev` (send the full
        layout). O(moves) for an epoch made from `prev` by replace()/bump(), else O(nodes)."""
        if self.world_size != prev.world_size or len(self.node_ranks) != len(prev.node_ranks):
            return None
        made = self._made_from
        if made is not None and made[0]() is prev:
            return self._delta(prev.epoch, made[1])
        gone = [n for n in prev.node_ranks if n not in self.node_ranks]
        came = {tuple(self.node_ranks[n]): n for n in self.node_ranks if n not in prev.node_ranks}
        moves: dict[str, str] = {}
        for n in gone:
            new = came.pop(tuple(prev.node_ranks[n]), None)
            if new is None:
                return None
            moves[n] = new
        if came:
            return None
        for n, r in self.node_ranks.items():
            if n in prev.node_ranks and prev.node_ranks[n] != r:
                return None
        return self._delta(prev.epoch, moves)

    def _delta(self, base: int, moves: dict[str, str]) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "base": base,
            "world_size": self.world_size,
            "moves": dict(moves),
            "committed": self.committed,
        }

    def apply_delta(self, delta: dict[str, Any]) -> Membership:
        """The next epoch from a delta made by `delta_from(self)`; DeltaMismatch when the
        delta was made against another epoch or names nodes this layout does not have.
        A partial layout (a node's view) applies the moves of the nodes it names. The new
        epoch's committed floor is the delta's (ValueError if it is not a step)."""
        base, epoch = int(delta["base"]), int(delta["epoch"])
        if base != self.epoch or epoch <= base or int(delta["world_size"]) != self.world_size:
            raise DeltaMismatch(f"delta {base}->{epoch} does not apply to epoch {self.epoch}")
        moves = {str(k): str(v) for k, v in dict(delta["moves"]).items()}
        committed = _step(delta.get("committed"))
        if self.partial:
            layout = {moves.get(n, n): r for n, r in self.node_ranks.items()}
            return Membership(epoch, self.world_size, layout, committed)
        for old, new in moves.items():
            if old not in self.node_ranks or (new in self.node_ranks and new not in moves):
                raise DeltaMismatch(f"delta {base}->{epoch} moves {old} -> {new}: not in epoch {self.epoch}")
        layout = {moves.get(n, n): r for n, r in self.node_ranks.items()}
        if len(layout) != len(self.node_ranks):
            raise DeltaMismatch(f"delta {base}->{epoch} merges nodes")
        return Membership(epoch, self.world_size, layout, committed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "world_size": self.world_size,
            "node_ranks": {n: list(r) for n, r in self.node_ranks.items()},
            "committed": self.committed,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Membership:
        """ValueError for a committed floor that is not a step (absent: 0, as journals
        written before it was carried)."""
        return Membership(
            int(d["epoch"]),
            int(d["world_size"]),
            {str(n): tuple(int(x) for x in r) for n, r in d["node_ranks"].items()},
            _step(d.get("committed")),
        )

    @staticmethod
    def initial(active_nodes: list[str], nproc_per_node: int) -> Membership:
        layout = {n: tuple(range(i * nproc_per_node, (i + 1) * nproc_per_node)) for i, n in enumerate(active_nodes)}
        return Membership(1, len(active_nodes) * nproc_per_node, layout)
