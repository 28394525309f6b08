"""Wire protocol: one module owns framing, versioning and validation.

Every message is a single JSON frame (never pickle) carrying a protocol
version, a type, the sender, a per-sender monotonic sequence number and an
absolute wall-clock deadline (wall clock because peers live on different
hosts; monotonic clocks are not comparable between them).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # control messages only; state travels over torch collectives


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
    FATAL = "fatal"    # the job cannot go on (e.g. every replica of a shard lost): stop it
    # controller -> peers
    WELCOME = "welcome"
    MEMBERSHIP = "membership"
    FENCE = "fence"
    SHUTDOWN = "shutdown"
    INJECT = "inject"
    PING = "ping"  # "answer with a heartbeat now": a liveness probe after a collective error
    # either way
    STATUS = "status"
    STATUS_REPLY = "status_reply"
    ERROR = "error"


class ProtocolError(Exception):
    """A frame that cannot be accepted; `code` is sent back in an ERROR reply."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


@dataclass(frozen=True)
class Message:
    type: MsgType
    sender: str
    seq: int
    deadline: float
    body: dict[str, Any] = field(default_factory=dict)
    v: int = PROTOCOL_VERSION

    def expired(self, now_wall: float | None = None) -> bool:
        return (time.time() if now_wall is None else now_wall) > self.deadline


def encode(msg: Message) -> bytes:
    return json.dumps(
        {"v": msg.v, "type": msg.type.value, "sender": msg.sender, "seq": msg.seq,
         "deadline": msg.deadline, "body": msg.body},
        separators=(",", ":"),
    ).encode()


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raises ProtocolError, never anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("too_large", f"{len(frame)} bytes > {MAX_FRAME_BYTES}")
    try:
        raw = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError("malformed", f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("malformed", "frame is not a JSON object")
    v = raw.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {v!r}, this peer speaks {PROTOCOL_VERSION}")
    try:
        mtype = MsgType(raw.get("type"))
    except ValueError:
        raise ProtocolError("bad_type", f"unknown message type {raw.get('type')!r}") from None
    sender, seq, deadline, body = raw.get("sender"), raw.get("seq"), raw.get("deadline"), raw.get("body", {})
    if not isinstance(sender, str) or not sender:
        raise ProtocolError("malformed", "sender must be a non-empty string")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise ProtocolError("malformed", "seq must be a non-negative integer")
    if not isinstance(deadline, (int, float)) or isinstance(deadline, bool):
        raise ProtocolError("malformed", "deadline must be a number (unix seconds)")
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "body must be a JSON object")
    return Message(mtype, sender, seq, float(deadline), body, v)


class Sequencer:
    """Builds outgoing messages for one sender with a monotonic sequence number."""

    def __init__(self, sender: str, default_ttl_s: float = 10.0) -> None:
        self.sender = sender
        self.default_ttl_s = default_ttl_s
        self._seq = 0

    def make(self, mtype: MsgType, body: dict[str, Any] | None = None, ttl_s: float | None = None) -> Message:
        self._seq += 1
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        return Message(mtype, self.sender, self._seq, time.time() + ttl, body or {})
