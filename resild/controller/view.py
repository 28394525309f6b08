"""The controller's view of the job: each node's role and bookkeeping, each rank's
last progress report, the current epoch. Built and mutated by the controller only;
the policy reads it (pure decisions)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from resild.membership import Membership, NodeRole, check_transition


@dataclass(frozen=True)
class JobResult:
    exit_code: int
    reason: str


@dataclass(slots=True)  # slots: a field written but never declared fails at once
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
    health_reasons: tuple[str, ...] = ()  # why, from its last HEALTH message (a degraded GPU's: evidence)
    # Control-plane bookkeeping (the policy never reads these).
    relayed: frozenset[int] = frozenset()  # local ranks that get membership through the node's relay
    epoch_sent: int = 0  # last epoch sent to the node process (full or delta)
    epoch_have: int = 0  # last epoch the node process said it holds (heartbeats)
    membership_sent_s: float = -1e9  # when an epoch (view or delta) was last sent to it (resend throttle)
    fenced_heard_s: float = -1e9  # a fenced node still spoke then (re-admission waits for its silence)
    admitted_s: float | None = None  # joined or re-admitted into the running job then (None: a start-up node)

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
    t_s: float = 0.0  # controller-side monotonic time of the last report


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
    probe_epoch: int = 0  # the epoch whose collective failed
    exceptions_seen: list[str] = field(default_factory=list)  # worker exception texts, oldest first
    # When a stall with every rank waiting in a collective was last answered with a re-form
    # (policy.check_hang): a second such stall with no commit since ends the job.
    stall_reformed_s: float | None = None
    # Shrink and grow (--min-replicas): the job's full width (the first epoch's world size) and
    # the fewest replicas it may train on with no spare left (0: never shrink). Every rank of a
    # job that may shrink is a replica of the state (the workers refuse any other at attach).
    full_world: int = 0
    min_replicas: int = 0
    # Ranks per replica group, as rank 0 said at attach (1: data parallel; HSDP: the ranks of
    # one replicate coordinate). 0: not said (yet, or lost with a leader): no shrink.
    replica_ranks: int = 0
    # Nodes fenced on suspicion (policy.drain_verdict): when, and why. Not journaled: a new
    # leader forgives them (a missed drain costs a retry elsewhere, a wrong one a node).
    strikes: dict[str, list[float]] = field(default_factory=dict)
    drained: set[str] = field(default_factory=set)
    # Nodes ordered by last heartbeat, oldest first: the heartbeat check looks at the
    # head only (O(1) per tick, not O(nodes)). Keep it right by setting
    # last_heartbeat_s through beat() only.
    _hb_order: OrderedDict[str, None] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        for n in sorted(self.nodes.values(), key=lambda v: v.last_heartbeat_s):
            self._hb_order[n.node_id] = None

    def beat(self, node_id: str, now: float) -> None:
        newest = next(reversed(self._hb_order), None)
        self.nodes[node_id].last_heartbeat_s = now
        self._hb_order.move_to_end(node_id)
        if newest is not None and now < self.nodes[newest].last_heartbeat_s:
            # A time older than the newest (only a test's clock does this): re-sort, O(nodes).
            order = sorted(self._hb_order, key=lambda n: self.nodes[n].last_heartbeat_s)
            self._hb_order = OrderedDict.fromkeys(order)

    def by_heartbeat(self) -> Iterator[NodeView]:
        """Nodes, least recently heard from first."""
        for n in self._hb_order:
            yield self.nodes[n]

    def shift_clock(self, dt_s: float) -> None:
        """The controller did not run for `dt_s` (stopped, paused, starved): every age it
        judges by moves on by as much, so nobody is blamed for the controller's own silence
        (a node silent before keeps its age). A uniform shift keeps the heartbeat order."""
        for n in self.nodes.values():
            n.last_heartbeat_s += dt_s
        for p in self.progress.values():
            p.t_s += dt_s
        if self.last_commit_s:
            self.last_commit_s += dt_s
        self.epoch_started_s += dt_s
        if self.first_done_s is not None:
            self.first_done_s += dt_s
        if self.probe_sent_s is not None:
            self.probe_sent_s += dt_s

    def add(self, node: NodeView, now: float) -> None:
        """A node that joined the running job (admission.py); heard from now on."""
        assert node.node_id not in self.nodes, node.node_id
        self.nodes[node.node_id] = node
        self._hb_order[node.node_id] = None
        node.admitted_s = now
        self.beat(node.node_id, now)

    def spares(self) -> list[NodeView]:
        return [n for n in self.nodes.values() if n.role == NodeRole.SPARE]
