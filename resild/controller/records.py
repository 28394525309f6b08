"""Journal records: one typed class per action, the only place their JSON is made.

`to_dict` writes exactly the JSON the controller has always written (key order too), so
journals on disk stay readable both ways; `from_dict` is tolerant of missing keys (a
record from a test, or an older writer) and keeps a record of an action it does not know
(`Unknown`, written back unchanged): restore ignores those.

    start           the first epoch: every active worker registered
    replace_node    a decision (policy.Decision): fence `node`, `spare` takes its ranks
    drop_spare      a decision: a failed spare is fenced
    shrink          a decision: fence `node`, no spare left, the survivors renumbered (--min-replicas)
    grow            a decision: a shrunk job gives `spare` new ranks after the last
    reform          a decision: same layout, next epoch
    fail_job        a decision: the job's verdict, failed
    finish          a decision: the job's verdict, finished
    fault_fired     an injected fault fired (once, ever)
    replica_unit    rank 0 said the ranks of one replica group (--min-replicas: a shrink's unit)
    admit           nodes joined the running job as spares (`resil-run --join`)
    readmit         a node fenced on suspicion is back as a spare (readmission.py)
    controller_error  the controller's own error (loop.py): where, what; restore ignores it
    leader          a standby replica took the lead (replica.py)
    closed          the leader's last record: the job is over (replica.py)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from resild.controller.policy import Action, Decision
from resild.membership import Membership


def _membership(raw: Any) -> Membership | None:
    return Membership.from_dict(raw) if raw is not None else None


def _opt_str(raw: Any) -> str | None:
    return str(raw) if raw is not None else None


@dataclass(frozen=True)
class Start:
    ACTION: ClassVar[str] = "start"
    membership: Membership
    reason: str = "every active worker registered"
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "t_wall": self.t_wall,
            "action": self.ACTION,
            "reason": self.reason,
            "membership": self.membership.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Start:
        return cls(Membership.from_dict(d["membership"]), str(d.get("reason", "")), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class _Decided:
    """A policy decision, journaled before it is acted on; one subclass per action."""

    ACTION: ClassVar[str]
    reason: str
    node: str | None = None
    spare: str | None = None
    membership: Membership | None = None
    committed_step: int = 0
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "t_wall": self.t_wall,
            "action": self.ACTION,
            "reason": self.reason,
            "node": self.node,
            "spare": self.spare,
            "membership": self.membership.to_dict() if self.membership else None,
            "committed_step": self.committed_step,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        return cls(
            str(d.get("reason", "")),
            _opt_str(d.get("node")),
            _opt_str(d.get("spare")),
            _membership(d.get("membership")),
            int(d.get("committed_step") or 0),
            float(d.get("t_wall") or 0.0),
        )


@dataclass(frozen=True)
class ReplaceNode(_Decided):
    ACTION: ClassVar[str] = Action.REPLACE_NODE.value


@dataclass(frozen=True)
class DropSpare(_Decided):
    ACTION: ClassVar[str] = Action.DROP_SPARE.value


@dataclass(frozen=True)
class Shrink(_Decided):
    ACTION: ClassVar[str] = Action.SHRINK.value


@dataclass(frozen=True)
class Grow(_Decided):
    ACTION: ClassVar[str] = Action.GROW.value


@dataclass(frozen=True)
class Reform(_Decided):
    ACTION: ClassVar[str] = Action.REFORM.value


@dataclass(frozen=True)
class FailJob(_Decided):
    ACTION: ClassVar[str] = Action.FAIL_JOB.value


@dataclass(frozen=True)
class Finish(_Decided):
    ACTION: ClassVar[str] = Action.FINISH.value


Decided = ReplaceNode | DropSpare | Shrink | Grow | Reform | FailJob | Finish

_DECIDED: dict[Action, type[Decided]] = {
    Action.REPLACE_NODE: ReplaceNode,
    Action.DROP_SPARE: DropSpare,
    Action.SHRINK: Shrink,
    Action.GROW: Grow,
    Action.REFORM: Reform,
    Action.FAIL_JOB: FailJob,
    Action.FINISH: Finish,
}


def decided(d: Decision, committed_step: int, t_wall: float) -> Decided:
    """The journal record of a policy decision (never Action.NONE)."""
    return _DECIDED[d.action](d.reason, d.node, d.spare, d.membership, committed_step, t_wall)


@dataclass(frozen=True)
class FaultFired:
    ACTION: ClassVar[str] = "fault_fired"
    spec: str
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"t_wall": self.t_wall, "action": self.ACTION, "spec": self.spec}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultFired:
        return cls(str(d.get("spec", "")), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class ReplicaUnit:
    """Rank 0 said how many ranks one replica group holds (the unit a shrink drops)."""

    ACTION: ClassVar[str] = "replica_unit"
    ranks: int
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"t_wall": self.t_wall, "action": self.ACTION, "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaUnit:
        return cls(int(d.get("ranks") or 0), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class Admit:
    ACTION: ClassVar[str] = "admit"
    nodes: tuple[str, ...]
    reason: str = ""
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"t_wall": self.t_wall, "action": self.ACTION, "reason": self.reason, "nodes": list(self.nodes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Admit:
        return cls(tuple(str(n) for n in d.get("nodes") or ()), str(d.get("reason", "")), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class Readmit:
    ACTION: ClassVar[str] = "readmit"
    node: str
    reason: str = ""
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"t_wall": self.t_wall, "action": self.ACTION, "reason": self.reason, "node": self.node}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Readmit:
        return cls(str(d.get("node", "")), str(d.get("reason", "")), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class ControllerError:
    """An error of the controller's own (a handler's or the tick's exception): kept for
    the post-mortem; it changes nothing in the job's state."""

    ACTION: ClassVar[str] = "controller_error"
    where: str
    error: str
    count: int = 1  # errors at `where` since the last record of it
    fatal: bool = False  # the controller gave up (loop.py: it stops without a SHUTDOWN)
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "t_wall": self.t_wall,
            "action": self.ACTION,
            "where": self.where,
            "error": self.error,
            "count": self.count,
            "fatal": self.fatal,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ControllerError:
        return cls(
            str(d.get("where", "")),
            str(d.get("error", "")),
            int(d.get("count") or 1),
            bool(d.get("fatal", False)),
            float(d.get("t_wall") or 0.0),
        )


@dataclass(frozen=True)
class Leader:
    ACTION: ClassVar[str] = "leader"
    index: int
    pid: int
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.ACTION, "index": self.index, "pid": self.pid, "t_wall": self.t_wall}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Leader:
        return cls(int(d.get("index") or 0), int(d.get("pid") or 0), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class Closed:
    ACTION: ClassVar[str] = "closed"
    index: int
    t_wall: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"action": self.ACTION, "index": self.index, "t_wall": self.t_wall}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Closed:
        return cls(int(d.get("index") or 0), float(d.get("t_wall") or 0.0))


@dataclass(frozen=True)
class Unknown:
    """A record of an action this version does not know: kept as it is."""

    raw: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


Record = (
    Start
    | ReplaceNode
    | DropSpare
    | Shrink
    | Grow
    | Reform
    | FailJob
    | Finish
    | FaultFired
    | ReplicaUnit
    | Admit
    | Readmit
    | ControllerError
    | Leader
    | Closed
    | Unknown
)

_BY_ACTION: dict[str, Any] = {
    c.ACTION: c
    for c in (
        Start,
        ReplaceNode,
        DropSpare,
        Shrink,
        Grow,
        Reform,
        FailJob,
        Finish,
        FaultFired,
        ReplicaUnit,
        Admit,
        Readmit,
        ControllerError,
        Leader,
        Closed,
    )
}


def parse_record(d: dict[str, Any]) -> Record:
    """The typed record of one journal line (an unknown action: `Unknown`)."""
    cls = _BY_ACTION.get(str(d.get("action")))
    rec: Record = cls.from_dict(d) if cls is not None else Unknown(dict(d))
    return rec
