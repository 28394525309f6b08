"""Wire protocol: one module owns framing, versioning and validation.

Every message is a single JSON frame (never pickle) carrying a protocol
version, a type, the sender, a per-sender monotonic sequence number and an
absolute wall-clock deadline (wall clock because peers live on different
hosts; monotonic clocks are not comparable between them).

Validation happens once, in `decode`: every number is finite and in range,
every string bounded, and each message type's body is checked against its
typed class (`BODY_TYPES`), so handlers never see a malformed body. Keys a
body class does not name are passed through (peers of the same protocol
version may add optional fields) but still obey the generic limits.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from resild.events.schema import EventName

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # control messages only; state travels over torch collectives
MAX_INT = (1 << 53) - 1  # JSON numbers stay exact in every peer's parser up to here
MAX_DEPTH = 16  # nesting of a body: a deep frame must not exhaust a handler's stack


class MsgType(str, Enum):
    # node process / agent -> controller
    REGISTER_NODE = "register_node"
    HEARTBEAT = "heartbeat"
    WORKER_EXIT = "worker_exit"
    HEALTH = "health"
    # worker -> controller
    REGISTER_WORKER = "register_worker"
    PROGRESS = "progress"
    EVENT = "event"
    DONE = "done"
    FAILED = "failed"  # the worker is about to die of an exception: do not wait for its exit
    FATAL = "fatal"  # the job cannot go on (e.g. every replica of a shard lost): stop it
    # controller -> peers
    WELCOME = "welcome"
    MEMBERSHIP = "membership"
    FENCE = "fence"
    SHUTDOWN = "shutdown"
    INJECT = "inject"
    STORE = "store"  # worker -> controller: one rendezvous-key operation (resild.rendezvous)
    STORE_REPLY = "store_reply"  # controller -> worker: its answer, by request id
    PING = "ping"  # "answer with a heartbeat now": a liveness probe after a collective error
    MEMBERSHIP_DELTA = "membership_delta"  # to a node process holding the previous epoch: {epoch, base, moves}
    RELAY_HELLO = "relay_hello"  # worker -> its node process's relay: send me the current membership
    LEASE = "lease"  # controller -> node processes, every lease interval: "I am (still) your controller"
    # `resil-run --join` (the job's join key) -> controller: admit these nodes as spares;
    # answered with ADMIT (their keys are minted) or ERROR {code: "refused"}
    JOIN = "join"
    ADMIT = "admit"
    # local client -> node daemon (its unix socket): answered with HEALTH at once, then a
    # HEALTH push on every change of the published verdict (and a keepalive now and then)
    SUBSCRIBE_HEALTH = "subscribe_health"
    # either way
    STATUS = "status"
    STATUS_REPLY = "status_reply"
    ERROR = "error"


_MSG_TYPES: dict[str, MsgType] = {t.value: t for t in MsgType}  # decode's lookup (no Enum call per message)


class ProtocolError(Exception):
    """A frame that cannot be accepted; `code` is sent back in an ERROR reply."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


# ---- typed bodies ---------------------------------------------------------------------


def _f(
    kind: str,
    *,
    lo: float = 0,
    hi: float = MAX_INT,
    max_len: int = 256,
    required: bool = False,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A body field: `kind` is str | int | float | bool | strs (list of str) | ints (list of
    ints in [lo, hi]) | steps ({rank: step}, ranks as decimal strings, steps ints in [lo, hi];
    typed as dict[int, int]) | paces ({rank: seconds} in [0, hi]) | obj (JSON object)."""
    return field(
        default=None,
        metadata={"kind": kind, "lo": lo, "hi": hi, "max_len": max_len, "required": required, "choices": choices},
    )


NODE = 256  # node names, detectors, states
TEXT = 4096  # reasons, error texts (truncated by senders, refused beyond this)
PID = (1 << 31) - 1
RANK = (1 << 31) - 1
LOCAL_RANK = 1 << 16
MAX_ITEMS = 1 << 16  # entries of a list or map of ranks (a node's ranks)


@dataclass(frozen=True)
class Body:
    """Base of the typed message bodies. `from_dict` validates; unknown keys are kept in the
    dict (Message.body) but never reach the typed object."""

    node: str | None = _f("str", max_len=NODE)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Body:
        kw: dict[str, Any] = {}
        for name, meta in _spec(cls):
            v = raw.get(name)
            if v is None:
                if meta["required"]:
                    raise ProtocolError("bad_body", f"{name} is required")
                continue
            kw[name] = _check_field(name, v, meta)
        return cls(**kw)


# Each body class's (name, metadata) pairs, read once: decoding runs per message, and at
# thousands of messages a second dataclasses.fields() per message is a measurable share.
_SPECS: dict[type, tuple[tuple[str, Any], ...]] = {}


def _spec(cls: type) -> tuple[tuple[str, Any], ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple((f.name, f.metadata) for f in fields(cls))
    return spec


def _check_field(name: str, v: Any, m: Any) -> Any:
    kind = m["kind"]
    if kind == "str":
        if not isinstance(v, str) or len(v) > m["max_len"]:
            raise ProtocolError("bad_body", f"{name} must be a string of at most {m['max_len']} characters")
        if m["choices"] is not None and v not in m["choices"]:
            raise ProtocolError("bad_body", f"{name} must be one of {', '.join(m['choices'])}")
    elif kind == "int":
        if not isinstance(v, int) or isinstance(v, bool) or not m["lo"] <= v <= m["hi"]:
            raise ProtocolError("bad_body", f"{name} must be an integer in [{m['lo']}, {m['hi']}]")
    elif kind == "float":
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not math.isfinite(v)
            or not m["lo"] <= v <= m["hi"]
        ):
            raise ProtocolError("bad_body", f"{name} must be a finite number in [{m['lo']}, {m['hi']}]")
        v = float(v)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise ProtocolError("bad_body", f"{name} must be true or false")
    elif kind == "strs":
        if not isinstance(v, list) or len(v) > 256 or not all(isinstance(x, str) and len(x) <= m["max_len"] for x in v):
            raise ProtocolError(
                "bad_body", f"{name} must be a list of at most 256 strings of at most {m['max_len']} characters"
            )
        v = list(v)
    elif kind == "ints":
        if not isinstance(v, list) or len(v) > MAX_ITEMS or not all(_int_in(x, m["lo"], m["hi"]) for x in v):
            raise ProtocolError(
                "bad_body", f"{name} must be a list of at most {MAX_ITEMS} integers in [{m['lo']}, {m['hi']}]"
            )
        v = list(v)
    elif kind == "steps":
        v = _steps(name, v, m["lo"], m["hi"])
    elif kind == "paces":
        v = _paces(name, v, m["hi"])
    elif kind == "obj":
        if not isinstance(v, dict):
            raise ProtocolError("bad_body", f"{name} must be a JSON object")
    return v


def _int_in(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _steps(name: str, v: Any, lo: float, hi: float) -> dict[int, int]:
    """{rank: step} with ranks as decimal strings (JSON keys), in one pass: a node's
    commit report carries one entry per rank, at every commit."""
    out: dict[int, int] = {}
    if isinstance(v, dict) and len(v) <= MAX_ITEMS:
        for k, x in v.items():
            # type() is int: not a bool; keys are str (JSON), ascii digits only
            if type(x) is not int or not lo <= x <= hi or not 0 < len(k) <= 10 or not k.isascii() or not k.isdigit():
                break
            r = int(k)
            if r > RANK:
                break
            out[r] = x
        else:
            return out
    raise ProtocolError(
        "bad_body", f"{name} must map at most {MAX_ITEMS} ranks (decimal strings) to integers in [{lo}, {hi}]"
    )


def _paces(name: str, v: Any, hi: float) -> dict[int, float]:
    """{rank: seconds} with ranks as decimal strings (a node's commit report: each rank's
    mean pace since its last report)."""
    out: dict[int, float] = {}
    if isinstance(v, dict) and len(v) <= MAX_ITEMS:
        for k, x in v.items():
            ok = type(x) in (int, float) and math.isfinite(x) and 0 <= x <= hi
            if not ok or not 0 < len(k) <= 10 or not k.isascii() or not k.isdigit() or int(k) > RANK:
                break
            out[int(k)] = float(x)
        else:
            return out
    raise ProtocolError(
        "bad_body", f"{name} must map at most {MAX_ITEMS} ranks (decimal strings) to seconds in [0, {hi:g}]"
    )


@dataclass(frozen=True)
class RegisterNode(Body):
    pid: int | None = _f("int", lo=1, hi=PID)
    nproc: int | None = _f("int", lo=1, hi=1 << 16)
    epoch: int | None = _f("int")  # the epoch the node process holds
    relayed: list[int] | None = _f("ints", hi=LOCAL_RANK)  # local ranks its relay serves


@dataclass(frozen=True)
class Heartbeat(Body):
    health: str | None = _f("str", max_len=64)
    source: str | None = _f("str", max_len=64)
    pid: int | None = _f("int", lo=1, hi=PID)
    epoch: int | None = _f("int")  # the epoch the node process holds
    relayed: list[int] | None = _f("ints", hi=LOCAL_RANK)  # local ranks its relay serves (on change)
    resync: bool | None = _f("bool")  # it missed an epoch: send its view now


@dataclass(frozen=True)
class WorkerExit(Body):
    local_rank: int | None = _f("int", hi=1 << 16)
    pid: int | None = _f("int", lo=1, hi=PID)
    returncode: int | None = _f("int", lo=-255, hi=255)
    # The worker's last output said its collectives were mismatched (launcher/node/worker_output.py)
    collective_mismatch: str | None = _f("str", max_len=TEXT)


@dataclass(frozen=True)
class Health(Body):
    verdict: str | None = _f("str", required=True, choices=("healthy", "degraded", "failed", "unknown"))
    reasons: list[str] | None = _f("strs", max_len=TEXT)
    detector: str | None = _f("str", max_len=64)


@dataclass(frozen=True)
class RegisterWorker(Body):
    """To the controller: node + local_rank + pid; to a node daemon: pid + name."""

    local_rank: int | None = _f("int", hi=1 << 16)
    pid: int | None = _f("int", lo=1, hi=PID)
    name: str | None = _f("str", max_len=128)


@dataclass(frozen=True)
class Progress(Body):
    """To the controller: rank/epoch/step/state; to a node daemon: pid + step."""

    rank: int | None = _f("int", hi=RANK)
    epoch: int | None = _f("int")
    step: int | None = _f("int")
    state: str | None = _f("str", max_len=32)
    error: str | None = _f("str", max_len=TEXT)
    pid: int | None = _f("int", lo=1, hi=PID)
    # A node process's aggregate of its ranks' commits (with `epoch`): {rank: step}
    commits: dict[int, int] | None = _f("steps")
    # ... with each rank's mean pace (seconds of its own compute per step) since its last
    # report, and the steps the loop was asked for (stragglers: resild.controller.stragglers)
    paces: dict[int, float] | None = _f("paces", hi=1e6)
    of: int | None = _f("int")


# Events peers may emit under their own name (the runtime's recovery milestones and the
# node daemon's process watch); any other peer event is renamed "worker.<name>", so a
# peer can never forge a controller event (failure_detected, job_finished, ...).
PEER_EVENTS: dict[str, dict[str, Any]] = {
    EventName.GROUP_REFORMED: {"seconds": _f("float", hi=1e9, required=True).metadata},
    EventName.STATE_REPLAYED: {
        "bytes": _f("int", required=True).metadata,
        "seconds": _f("float", hi=1e9, required=True).metadata,
    },
    EventName.RESUMED: {"step": _f("int", required=True).metadata, "seconds": _f("float", hi=1e9).metadata},
    EventName.ROLLED_BACK: {
        "step": _f("int", required=True).metadata,
        "newest": _f("int", required=True).metadata,
        "steps_redone": _f("int", required=True).metadata,
    },
    EventName.SNAPSHOT_CORRUPT: {"src": _f("int", hi=RANK).metadata, "step": _f("int").metadata},
    EventName.SNAPSHOTS: {"taken": _f("int").metadata, "held_bytes": _f("int").metadata},
    EventName.SNAPSHOT_CADENCE: {"every": _f("int", lo=1, required=True).metadata, "reason": _f("str").metadata},
    EventName.REPLICA_DIVERGED: {"step": _f("int", required=True).metadata},
    EventName.STATE_UNVOUCHED: {"step": _f("int", required=True).metadata},
    EventName.REPLICA_ARBITRATED: {"step": _f("int", required=True).metadata},
    EventName.STEPS_VERIFIED: {"verified": _f("int", required=True).metadata},
    EventName.GRADIENTS_DIFFERED: {"step": _f("int", required=True).metadata, "ranks": _f("int", hi=RANK).metadata},
    EventName.AGREED_STATE: {"kept": _f("int").metadata, "held_bytes": _f("int").metadata},
    EventName.CHECKPOINT_LOADED: {"step": _f("int", required=True).metadata},
    EventName.CHECKPOINT_SAVED: {"step": _f("int", required=True).metadata, "seconds": _f("float", hi=1e9).metadata},
    EventName.CHECKPOINT_FAILED: {"step": _f("int").metadata, "seconds": _f("float", hi=1e9).metadata},
    EventName.CHECKPOINT_DEFERRED: {"step": _f("int", required=True).metadata},
    EventName.SPARE_WARMED: {"seconds": _f("float", hi=1e9).metadata},
    EventName.SPARE_COMPILED: {"graphs": _f("int", required=True).metadata},
    EventName.REPLICA_LAYOUT: {
        "unit": _f("int", lo=1, hi=RANK, required=True).metadata,
        "replicas": _f("int", lo=1, hi=RANK).metadata,
    },
    EventName.PROCESS_RUNNING: {},
    EventName.PROCESS_EXITED: {},
    EventName.PROCESS_ZOMBIE: {},
    EventName.PROCESS_HUNG: {},
}
WORKER_EVENT_PREFIX = "worker."
_EVENT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_EVENT_COMMON = {
    "rank": _f("int", hi=RANK).metadata,
    "epoch": _f("int").metadata,
    "t_mono": _f("float", lo=-1e12, hi=1e12).metadata,
}
_EVENT_RESERVED = ("node", "event", "t_wall")  # set by the controller's event log


@dataclass(frozen=True)
class Event(Body):
    name: str | None = _f("str", max_len=64, required=True)
    fields: dict[str, Any] | None = _f("obj")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Body:
        ev = super().from_dict(raw)
        assert isinstance(ev, Event) and ev.name is not None
        if not _EVENT_NAME.fullmatch(ev.name):
            raise ProtocolError("bad_body", "event name must be 1-64 characters of [A-Za-z0-9_.:-]")
        fl = ev.fields or {}
        if any(k in fl for k in _EVENT_RESERVED):
            raise ProtocolError("bad_body", f"event fields must not set {', '.join(_EVENT_RESERVED)}")
        spec = dict(_EVENT_COMMON)
        name = ev.name
        if name in PEER_EVENTS:
            spec.update(PEER_EVENTS[name])
        elif not name.startswith(WORKER_EVENT_PREFIX):
            name = WORKER_EVENT_PREFIX + name
        for key, meta in spec.items():
            if fl.get(key) is None:
                if meta["required"]:
                    raise ProtocolError("bad_body", f"event {ev.name}: fields.{key} is required")
                continue
            _check_field(f"fields.{key}", fl[key], meta)
        return Event(ev.node, name, fl)


@dataclass(frozen=True)
class Done(Body):
    rank: int | None = _f("int", hi=RANK, required=True)
    epoch: int | None = _f("int", required=True)
    step: int | None = _f("int")
    pid: int | None = _f("int", lo=1, hi=PID)


@dataclass(frozen=True)
class Failed(Body):
    local_rank: int | None = _f("int", hi=1 << 16)
    pid: int | None = _f("int", lo=1, hi=PID)
    error: str | None = _f("str", max_len=TEXT)


@dataclass(frozen=True)
class Fatal(Body):
    error: str | None = _f("str", max_len=TEXT)


@dataclass(frozen=True)
class Welcome(Body):
    """The job's worker settings (WorkerTimeouts, WorkerRedundancy: their own checks), and
    to a worker the role of its node when it registered: a spare's worker warms up at once,
    an active one never fetches the warm-up recipe."""

    role: str | None = _f("str", max_len=16, choices=("active", "spare"))


@dataclass(frozen=True)
class MembershipBody(Body):
    epoch: int | None = _f("int", required=True)
    world_size: int | None = _f("int", lo=1, hi=RANK, required=True)
    node_ranks: dict[str, Any] | None = _f("obj", required=True)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Body:
        m = super().from_dict(raw)
        assert isinstance(m, MembershipBody) and m.node_ranks is not None and m.world_size is not None
        for n, ranks in m.node_ranks.items():
            if (
                len(n) > NODE
                or not isinstance(ranks, list)
                or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < m.world_size for r in ranks)
            ):
                raise ProtocolError("bad_body", f"node_ranks[{n[:64]!r}] must be a list of ranks < world_size")
        return m


@dataclass(frozen=True)
class Fence(Body):
    # Composed by the controller from causes (health reasons, exception texts): never refuse
    # a FENCE or SHUTDOWN for its length, only the frame limit bounds it.
    reason: str | None = _f("str", max_len=MAX_FRAME_BYTES)


@dataclass(frozen=True)
class Shutdown(Body):
    reason: str | None = _f("str", max_len=MAX_FRAME_BYTES)
    exit_code: int | None = _f("int", lo=-255, hi=255)


@dataclass(frozen=True)
class Inject(Body):
    kind: str | None = _f("str", max_len=32, required=True)
    local_rank: int | None = _f("int", hi=1 << 16)
    xid: int | None = _f("int", hi=1 << 16)
    pct: int | None = _f("int", hi=1000)  # slow: % of a step added


@dataclass(frozen=True)
class Lease(Body):
    """The leader's word to node processes. `term` rises with every new leader (a node
    follows the highest term it has heard); `interval_s` how often leases come,
    `timeout_s` how long a node process waits for the next before it gives up (derived
    once, by the controller: JobSettings.for_nodes)."""

    term: int | None = _f("int", required=True)
    leader: int | None = _f("int", hi=64)  # the leader's place in the controller endpoint list
    interval_s: float | None = _f("float", hi=3600.0)
    timeout_s: float | None = _f("float", hi=3 * 3600.0)
    pid: int | None = _f("int", lo=1, hi=PID)
    host: str | None = _f("str", max_len=NODE)


@dataclass(frozen=True)
class StoreRequest(Body):
    """A c10d store call over the authenticated link; values travel base64-encoded."""

    id: int | None = _f("int", required=True)
    op: str | None = _f(
        "str",
        max_len=16,
        required=True,
        choices=("set", "get", "add", "check", "wait", "compare_set", "delete", "num_keys", "multi_get"),
    )
    keys: list[str] | None = _f("strs", max_len=512)
    value: str | None = _f("str", max_len=MAX_FRAME_BYTES)
    expected: str | None = _f("str", max_len=MAX_FRAME_BYTES)
    n: int | None = _f("int", lo=-MAX_INT, hi=MAX_INT)
    timeout_s: float | None = _f("float", hi=3600.0)
    # worker -> its node process only: "node" for a group whose ranks all live on this node
    # (served by the node process itself), "job" for one the leading controller serves.
    scope: str | None = _f("str", max_len=8, choices=("node", "job"))


@dataclass(frozen=True)
class Join(Body):
    """Nodes asking to join a running job as spares. `job`: the job id of the run directory
    the joiner read (a controller of another job refuses)."""

    job: str | None = _f("str", max_len=64, required=True)
    nodes: list[str] | None = _f("strs", max_len=NODE, required=True)
    source: str | None = _f("str", max_len=64)  # "slurm:<job id>" of a cold-spare job; "local"


@dataclass(frozen=True)
class Admit(Body):
    """The controller's yes: `nodes` are the job's spares now; each one's key directory is
    `keys`/<node> under the job's key directory (minted by the controller)."""

    job: str | None = _f("str", max_len=64)
    nodes: list[str] | None = _f("strs", max_len=NODE)
    keys: str | None = _f("str", max_len=NODE)


@dataclass(frozen=True)
class ErrorBody(Body):
    code: str | None = _f("str", max_len=64)
    detail: str | None = _f("str", max_len=MAX_FRAME_BYTES)


BODY_TYPES: dict[MsgType, type[Body]] = {
    MsgType.REGISTER_NODE: RegisterNode,
    MsgType.HEARTBEAT: Heartbeat,
    MsgType.WORKER_EXIT: WorkerExit,
    MsgType.HEALTH: Health,
    MsgType.REGISTER_WORKER: RegisterWorker,
    MsgType.PROGRESS: Progress,
    MsgType.EVENT: Event,
    MsgType.DONE: Done,
    MsgType.FAILED: Failed,
    MsgType.FATAL: Fatal,
    MsgType.WELCOME: Welcome,
    MsgType.MEMBERSHIP: MembershipBody,
    MsgType.FENCE: Fence,
    MsgType.SHUTDOWN: Shutdown,
    MsgType.INJECT: Inject,
    MsgType.ERROR: ErrorBody,
    MsgType.LEASE: Lease,
    MsgType.STORE: StoreRequest,
    MsgType.JOIN: Join,
    MsgType.ADMIT: Admit,
}  # PING, STATUS, STATUS_REPLY and types without a class: generic checks only


@dataclass(frozen=True)
class Message:
    type: MsgType
    sender: str
    seq: int
    deadline: float
    body: dict[str, Any] = field(default_factory=dict)
    v: int = PROTOCOL_VERSION
    # The validated typed view of `body` (set by decode); handlers may keep reading `body`.
    typed: Body | None = field(default=None, compare=False, repr=False)

    def expired(self, now_wall: float | None = None) -> bool:
        return (time.time() if now_wall is None else now_wall) > self.deadline


def encode(msg: Message) -> bytes:
    return json.dumps(
        {
            "v": msg.v,
            "type": msg.type.value,
            "sender": msg.sender,
            "seq": msg.seq,
            "deadline": msg.deadline,
            "body": msg.body,
        },
        separators=(",", ":"),
        allow_nan=False,
    ).encode()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


# One decoder for every frame (json.loads with an option builds a new one per call).
# Frames are UTF-8: every sender is json.dumps(...).encode().
_DECODER = json.JSONDecoder(parse_constant=_no_constant)


_INT_LO, _INT_HI = -(1 << 63), 1 << 63


def _check_json(v: Any, depth: int = 0) -> None:
    """Generic limits on any body: bounded nesting, 64-bit integers, finite numbers
    (json parses 1e999 as inf; NaN/Infinity literals are refused by the parser)."""
    if depth > MAX_DEPTH or (depth == MAX_DEPTH and v):  # v's items would be deeper than the limit
        raise ProtocolError("malformed", f"body nested deeper than {MAX_DEPTH}")
    for x in v.values() if isinstance(v, dict) else v:
        t = type(x)
        if t is int:
            if not _INT_LO <= x < _INT_HI:
                raise ProtocolError("malformed", "integer out of 64-bit range")
        elif t is float:
            if not math.isfinite(x):
                raise ProtocolError("malformed", "not JSON: a number is not finite")
        elif t is dict or t is list:
            _check_json(x, depth + 1)


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raises ProtocolError, never anything else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("malformed", "frame is not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        raw = _DECODER.decode(bytes(frame).decode("utf-8"))  # floats: _check_json and the header checks
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError("malformed", f"not JSON: {str(e)[:200]}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", "frame is not a JSON object")
    v = raw.get("v")
    if v != PROTOCOL_VERSION or isinstance(v, bool):
        raise ProtocolError("bad_version", f"protocol version {str(v)[:20]!r}, this peer speaks {PROTOCOL_VERSION}")
    mtype = _MSG_TYPES.get(t) if isinstance(t := raw.get("type"), str) else None
    if mtype is None:
        raise ProtocolError("bad_type", f"unknown message type {str(t)[:64]!r}")
    sender, seq, deadline, body = raw.get("sender"), raw.get("seq"), raw.get("deadline"), raw.get("body", {})
    if not isinstance(sender, str) or not sender or len(sender) > NODE:
        raise ProtocolError("malformed", f"sender must be a non-empty string of at most {NODE} characters")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq <= MAX_INT:
        raise ProtocolError("malformed", f"seq must be an integer in [0, {MAX_INT}]")
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or not math.isfinite(deadline):
        raise ProtocolError("malformed", "deadline must be a finite number (unix seconds)")
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "body must be a JSON object")
    _check_json(body)
    if abs(deadline) > 1e12:
        raise ProtocolError("malformed", "deadline out of range")
    cls = BODY_TYPES.get(mtype)
    typed = cls.from_dict(body) if cls is not None else None
    if isinstance(typed, Event) and typed.name != body.get("name"):
        body = {**body, "name": typed.name}  # namespaced: the handlers emit what decode decided
    return Message(mtype, sender, seq, float(deadline), body, PROTOCOL_VERSION, typed)


def seq_origin() -> int:
    """Where a sender's sequence starts: microseconds of wall clock, so a restarted
    sender (same name) starts above what its previous incarnation sent and the
    receiver's per-sender high-water mark (transport.Channel) still accepts it."""
    return int(time.time() * 1e6)


class Sequencer:
    """Builds outgoing messages for one sender with a monotonic sequence number."""

    def __init__(self, sender: str, default_ttl_s: float = 10.0) -> None:
        self.sender = sender
        self.default_ttl_s = default_ttl_s
        self._seq = seq_origin()

    def make(self, mtype: MsgType, body: dict[str, Any] | None = None, ttl_s: float | None = None) -> Message:
        self._seq += 1
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        return Message(mtype, self.sender, self._seq, time.time() + ttl, body or {})
