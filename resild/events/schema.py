"""The event schema: every event name resild writes, and typed records for the events
the analyses read (`resild.report.recoveries`, `resild report`, resil-run's tables).

Names are the strings that have always been written: `EventName` is a ``(str, Enum)``
whose members compare *and hash* equal to their values, so ``e["event"] == EventName.X``,
``e["event"] in {EventName.X}`` and JSON files written before this module existed all
keep working. (Not ``StrEnum``: ``str()`` of a member is its qualified name, and the
event log stores the plain value, see `resild.events.log.EventLog.emit`.)

Records are read from users' files, which may be torn, old, hand-edited or foreign:
``from_record`` never raises. A missing or badly typed field becomes None (or the
field's neutral default); a record without a usable time, or of another event, gives
None. Names this module does not know are not errors: `parse` returns None for them and
the analyses skip them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, TypeVar


class Detector(str, Enum):
    """Who saw a failure (`failure_detected`'s `detector`, the HEALTH body's): owned here,
    as event names are. A health event's detector is `health_event_detector`'s."""

    PROCESS_EXIT = "process-exit"  # the node process saw a worker (or a node process) exit
    HEARTBEAT = "heartbeat"  # the controller heard nothing from a node for its timeout
    HANG = "hang"  # a rank made no progress for --hang-timeout
    EXCEPTION = "exception"  # a worker raised in its training step
    PROBE = "probe"  # the controller's own probe verdict (and a re-form without a fence)
    GPU_PROBE = "gpu-probe"  # a HEALTH report that named no detector (an older node)
    RUNTIME = "runtime"  # a worker's FATAL: the job cannot go on
    AGENT = "resild-agent"  # the node daemon's verdict
    DAEMON = "daemon"  # the node process following the daemon (restarted, silent)
    PROBE_POLL = "probe-poll"  # the node process's own periodic probes (no daemon)
    QUALIFY = "qualify"  # a joining node's qualification failed
    STRAGGLER = "straggler"  # the controller replaced a persistently slow node (resild.controller.stragglers)
    UNKNOWN = "unknown"  # no health source could tell


def health_event_detector(kind: str, kernel_log: bool) -> str:
    """The detector of a probe's health event: "nvml-<kind>", or "kmsg-<kind>" for what
    the kernel log saw on no GPU NVML knows (e.g. "nvml-xid", "kmsg-xid")."""
    return f"{'kmsg' if kernel_log else 'nvml'}-{kind}"


class RestoreSource(str, Enum):
    """Where a recovery restored a lost rank's state from (`state_replayed`, `resumed`):
    the worker's restore sources (launcher/worker/sources/) are named by these."""

    REPLICA = "replica"  # a live replica's memory: nothing redone
    SNAPSHOT = "snapshot"  # every rank rolled back to a peer-memory snapshot
    CHECKPOINT = "checkpoint"  # every rank loaded resild's newest disk checkpoint


class EventName(str, Enum):
    # -- the controller (resild/controller/loop.py, replica.py, journal.py) -------------
    JOB_STARTED = "job_started"
    NODE_REGISTERED = "node_registered"
    WORKER_REGISTERED = "worker_registered"
    MEMBERSHIP = "membership"
    PROGRESS = "progress"  # throttled committed step (EventLog.progress)
    COLLECTIVE_FAILED = "collective_failed"  # the first rank report of a failed collective
    FAULT_INJECTED = "fault_injected"
    FAILURE_DETECTED = "failure_detected"
    NODE_FENCED = "node_fenced"
    NODE_SUSPECT = "node_suspect"  # a worker failed without evidence against the node: not drained (yet)
    SPARE_ASSIGNED = "spare_assigned"
    JOB_RESIZED = "job_resized"  # no spare left: the job shrank (a node's replicas dropped), or grew back
    REFORM = "reform"  # a transient failure: same layout, new epoch
    FULL_STRENGTH_STEP = "full_strength_step"  # the first commit of a new epoch
    RANK_DONE = "rank_done"
    JOB_FINISHED = "job_finished"
    JOB_FAILED = "job_failed"
    CONTROLLER_RESTORED = "controller_restored"
    CONTROLLER_LEADER = "controller_leader"
    CONTROLLER_STALLED = "controller_stalled"  # the controller did not run for `seconds`: ages shifted
    JOURNAL_ERROR = "journal_error"
    PEER_REFUSED = "peer_refused"  # a key holder spoke as another node (routing id, sender, body)
    NODE_ABUSIVE = "node_abusive"  # a node stayed over its message budget: fenced (policy.abuse_verdict)
    CONTROLLER_ERROR = "controller_error"  # the controller's own bug: logged, the job goes on (loop.py)
    NODE_ADMITTED = "node_admitted"  # a node joined the running job as a spare (resil-run --join)
    JOIN_REFUSED = "join_refused"  # a request to join was refused: the reason, nothing changed
    NODE_READMITTED = "node_readmitted"  # a node fenced on suspicion is back as a spare (qualified first)
    STRAGGLER = "straggler"  # a node persistently slower than the others: replaced, or only reported (why)
    STRAGGLERS_UNWATCHED = "stragglers_unwatched"  # --straggler-window is longer than the job: no one can be found
    SPARES_REQUESTED = "spares_requested"  # the pool is below --spare-target: cold spares asked of the queue
    # -- peers (resild.wire.protocol.PEER_EVENTS): workers ----------------------------------
    GROUP_REFORMED = "group_reformed"
    STATE_REPLAYED = "state_replayed"
    RESUMED = "resumed"
    ROLLED_BACK = "rolled_back"  # every rank went back: to the newest complete snapshot, or past a divergence
    SNAPSHOT_CORRUPT = "snapshot_corrupt"  # a held snapshot copy failed its checksum and was dropped
    SNAPSHOT_CADENCE = "snapshot_cadence"  # rank 0: --snapshot-every auto agreed on another cadence
    SNAPSHOTS = "snapshots"  # a rank's snapshot costs (taken, skipped, capture seconds, memory), before DONE
    REPLICA_DIVERGED = "replica_diverged"  # replicas' state fingerprints differ (odd ranks, or no majority)
    AGREED_STATE = "agreed_state"  # a rank: its last-agreed-state copies (kept, seconds, bytes), before DONE
    STEPS_VERIFIED = "steps_verified"  # a rank: steps it computed twice alike (--verify-every), before DONE
    GRADIENTS_DIFFERED = "gradients_differed"  # a rank computed a step twice and got two results (--verify-every)
    REPLICA_ARBITRATED = "replica_arbitrated"  # a spare's recomputation named the faulty one of two replicas
    STATE_UNVOUCHED = "state_unvouched"  # rank 0: the state carries a divergence nothing rolled back (why)
    CHECKPOINT_LOADED = "checkpoint_loaded"  # every in-memory copy lost: resild's disk checkpoint loaded
    CHECKPOINT_SAVED = "checkpoint_saved"  # rank 0: a disk checkpoint is COMPLETE on every rank
    CHECKPOINT_FAILED = "checkpoint_failed"  # rank 0: a save failed, was abandoned by a recovery, or never ended
    CHECKPOINT_DEFERRED = "checkpoint_deferred"  # rank 0: a due save waits for a writer still busy (said once)
    SPARE_WARMED = "spare_warmed"  # a waiting spare's warm-up for the job's sharded state ended (or its error)
    SPARE_COMPILED = "spare_compiled"  # a spare's first step after taking over: the graphs it still had to compile
    REPLICA_LAYOUT = "replica_layout"  # rank 0, under --min-replicas: ranks per replica group (a shrink's unit)
    # -- peers: the node daemon's process watch ("process_" + ProcState) -------------------
    PROCESS_RUNNING = "process_running"
    PROCESS_EXITED = "process_exited"
    PROCESS_ZOMBIE = "process_zombie"
    PROCESS_HUNG = "process_hung"

    # Enum hashes members by name; hash like the value instead, so that members and the
    # plain strings read back from a file are interchangeable as dict keys and set items.
    def __hash__(self) -> int:
        return str.__hash__(self)


# Any other peer event reaches the log as "worker.<name>" (resild.wire.protocol).
WORKER_EVENT_PREFIX = "worker."


# ---- tolerant field readers ------------------------------------------------------------------
def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float, str)):
        try:
            f = float(v)
        except (ValueError, OverflowError):  # a word; an int past a float's range
            return None
        return f if math.isfinite(f) else None
    return None


def as_float(v: Any) -> float | None:
    """A finite number (or a numeric string), else None."""
    return _num(v)


def as_int(v: Any) -> int | None:
    """An integer (an integral float or numeric string too), else None."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    f = _num(v)
    return int(f) if f is not None and f == int(f) else None


def as_str(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else str(v)


def event_time(rec: Mapping[str, Any]) -> float | None:
    """A record's instant on the log's (the controller's) clock: ``t_log`` when the sender
    stamped its own clock (a worker on another host), else ``t_mono``."""
    t = _num(rec.get("t_log"))
    return t if t is not None else _num(rec.get("t_mono"))


def event_name(rec: Mapping[str, Any]) -> EventName | None:
    """The record's name as an EventName; None for names this schema does not know."""
    name = rec.get("event")
    if not isinstance(name, str):
        return None
    try:
        return EventName(name)
    except ValueError:
        return None


# ---- typed records ---------------------------------------------------------------------------
R = TypeVar("R", bound="Record")


@dataclass
class Record:
    NAME: ClassVar[EventName]
    t: float  # event_time: the log's clock

    @classmethod
    def from_record(cls: type[R], rec: Mapping[str, Any]) -> R | None:
        """The typed event, or None when `rec` is not this event or has no usable time."""
        if not isinstance(rec, Mapping) or rec.get("event") != cls.NAME:
            return None
        t = event_time(rec)
        if t is None:
            return None
        return cls._fields(t, rec)

    @classmethod
    def _fields(cls: type[R], t: float, rec: Mapping[str, Any]) -> R:
        return cls(t)


@dataclass
class JobStarted(Record):
    NAME = EventName.JOB_STARTED
    nodes: list[str] = field(default_factory=list)

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> JobStarted:
        nodes = rec.get("nodes")
        return cls(t, [str(n) for n in nodes] if isinstance(nodes, list) else [])


@dataclass
class NodeRegistered(Record):
    NAME = EventName.NODE_REGISTERED
    node: str | None = None
    role: str | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> NodeRegistered:
        return cls(t, as_str(rec.get("node")), as_str(rec.get("role")))


@dataclass
class MembershipEvent(Record):
    NAME = EventName.MEMBERSHIP
    epoch: int | None = None
    nodes: list[str] = field(default_factory=list)  # the layout's nodes, in its order

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> MembershipEvent:
        layout = rec.get("layout")
        return cls(t, as_int(rec.get("epoch")), [str(n) for n in layout] if isinstance(layout, dict) else [])


@dataclass
class Progress(Record):
    NAME = EventName.PROGRESS
    step: int | None = None
    epoch: int | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> Progress:
        return cls(t, as_int(rec.get("step")), as_int(rec.get("epoch")))


@dataclass
class CollectiveFailed(Record):
    NAME = EventName.COLLECTIVE_FAILED
    rank: int | None = None
    epoch: int | None = None
    error: str = ""

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> CollectiveFailed:
        return cls(t, as_int(rec.get("rank")), as_int(rec.get("epoch")), as_str(rec.get("error")) or "")


@dataclass
class FaultInjected(Record):
    NAME = EventName.FAULT_INJECTED
    node: str | None = None
    kind: str | None = None
    spec: str | None = None
    step: int | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> FaultInjected:
        return cls(
            t, as_str(rec.get("node")), as_str(rec.get("kind")), as_str(rec.get("spec")), as_int(rec.get("step"))
        )


@dataclass
class FailureDetected(Record):
    NAME = EventName.FAILURE_DETECTED
    node: str | None = None
    cause: str = ""
    detector: str = ""
    committed_step: int | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> FailureDetected:
        return cls(
            t,
            as_str(rec.get("node")),
            as_str(rec.get("cause") or rec.get("reason")) or "",
            as_str(rec.get("detector")) or "",
            as_int(rec.get("committed_step")),
        )


@dataclass
class Reform(Record):
    NAME = EventName.REFORM
    epoch: int | None = None
    reason: str = ""

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> Reform:
        return cls(t, as_int(rec.get("epoch")), as_str(rec.get("reason")) or "")


@dataclass
class NodeFenced(Record):
    NAME = EventName.NODE_FENCED
    node: str | None = None
    reason: str = ""

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> NodeFenced:
        return cls(t, as_str(rec.get("node")), as_str(rec.get("reason")) or "")


@dataclass
class SpareAssigned(Record):
    NAME = EventName.SPARE_ASSIGNED
    spare: str | None = None
    failed: str | None = None
    epoch: int | None = None
    spares_left: int | None = None
    before_start: bool = False  # the failed node was replaced before the first epoch ran

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> SpareAssigned:
        return cls(
            t,
            as_str(rec.get("spare")),
            as_str(rec.get("failed")),
            as_int(rec.get("epoch")),
            as_int(rec.get("spares_left")),
            rec.get("before_start") is True,
        )


@dataclass
class JobResized(Record):
    """No spare was left and the job shrank (`how` "shrink": `node` lost), or it grew back
    (`how` "grow": `node` joined) into epoch `epoch` of `world_size` ranks."""

    NAME = EventName.JOB_RESIZED
    how: str = ""
    node: str | None = None
    epoch: int | None = None
    world_size: int | None = None
    spares_left: int | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> JobResized:
        return cls(
            t,
            as_str(rec.get("how")) or "",
            as_str(rec.get("node")),
            as_int(rec.get("epoch")),
            as_int(rec.get("world_size")),
            as_int(rec.get("spares_left")),
        )


@dataclass
class FullStrengthStep(Record):
    NAME = EventName.FULL_STRENGTH_STEP
    epoch: int | None = None
    step: int | None = None
    rank: int | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> FullStrengthStep:
        return cls(t, as_int(rec.get("epoch")), as_int(rec.get("step")), as_int(rec.get("rank")))


@dataclass
class GroupReformed(Record):
    """A worker's new process group is formed (`seconds`: its formation, worker clock)."""

    NAME = EventName.GROUP_REFORMED
    epoch: int | None = None
    rank: int | None = None
    seconds: float | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> GroupReformed:
        return cls(t, as_int(rec.get("epoch")), as_int(rec.get("rank")), as_float(rec.get("seconds")))


@dataclass
class StateReplayed(Record):
    """A rank received the state it was behind on (`seconds`: the transfer)."""

    NAME = EventName.STATE_REPLAYED
    epoch: int | None = None
    rank: int | None = None
    bytes: int = 0
    seconds: float | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> StateReplayed:
        return cls(
            t,
            as_int(rec.get("epoch")),
            as_int(rec.get("rank")),
            as_int(rec.get("bytes")) or 0,
            as_float(rec.get("seconds")),
        )


@dataclass
class Resumed(Record):
    """Rank 0 restarts training at `step` (`seconds`: its whole recovery, worker clock)."""

    NAME = EventName.RESUMED
    epoch: int | None = None
    step: int | None = None
    seconds: float | None = None
    source: str | None = None  # a RestoreSource value; older logs: None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> Resumed:
        src = rec.get("source")
        return cls(
            t,
            as_int(rec.get("epoch")),
            as_int(rec.get("step")),
            as_float(rec.get("seconds")),
            src if src in {s.value for s in RestoreSource} else None,
        )


@dataclass
class RolledBack(Record):
    """Every rank went back to `step` from `newest` (no replica left: a snapshot; or
    `reason` "divergence": the replicas' last agreed state)."""

    NAME = EventName.ROLLED_BACK
    epoch: int | None = None
    step: int | None = None
    newest: int | None = None
    reason: str | None = None

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> RolledBack:
        return cls(
            t, as_int(rec.get("epoch")), as_int(rec.get("step")), as_int(rec.get("newest")), as_str(rec.get("reason"))
        )


@dataclass
class StateUnvouched(Record):
    """The state carries a divergence nothing rolled back: `reason` says why."""

    NAME = EventName.STATE_UNVOUCHED
    step: int | None = None
    reason: str = ""

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> StateUnvouched:
        return cls(t, as_int(rec.get("step")), as_str(rec.get("reason")) or "")


@dataclass
class JobFinished(Record):
    NAME = EventName.JOB_FINISHED
    reason: str = ""
    step: int | None = None  # steps committed after the first one the controller saw
    final_step: int | None = None
    train_s: float | None = None
    step_s: float | None = None
    unvouched: str | None = None  # why resild cannot vouch for the final state; None: it can

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> JobFinished:
        return cls(
            t,
            as_str(rec.get("reason")) or "",
            as_int(rec.get("step")),
            as_int(rec.get("final_step")),
            as_float(rec.get("train_s")),
            as_float(rec.get("step_s")),
            as_str(rec.get("unvouched")),
        )


@dataclass
class JobFailed(Record):
    NAME = EventName.JOB_FAILED
    reason: str = ""

    @classmethod
    def _fields(cls, t: float, rec: Mapping[str, Any]) -> JobFailed:
        return cls(t, as_str(rec.get("reason")) or "")


RECORDS: dict[EventName, type[Record]] = {
    c.NAME: c
    for c in (
        JobStarted,
        NodeRegistered,
        MembershipEvent,
        Progress,
        CollectiveFailed,
        FaultInjected,
        FailureDetected,
        Reform,
        NodeFenced,
        SpareAssigned,
        JobResized,
        FullStrengthStep,
        GroupReformed,
        StateReplayed,
        Resumed,
        RolledBack,
        StateUnvouched,
        JobFinished,
        JobFailed,
    )
}


# The events a job's recoveries are computed from (resild.report.recoveries; resil-run's live
# status keeps these): every typed record but the steps' progress and the job's end.
RECOVERY_EVENTS = frozenset(RECORDS) - {EventName.PROGRESS, EventName.JOB_FINISHED, EventName.JOB_FAILED}


def parse(rec: Any) -> Record | None:
    """The typed record for `rec`; None for an event without a typed record (unknown
    names, `worker.*`, events no analysis reads), a malformed one, or a non-dict."""
    if not isinstance(rec, Mapping):
        return None
    name = event_name(rec)
    cls = RECORDS.get(name) if name is not None else None
    return cls.from_record(rec) if cls is not None else None
