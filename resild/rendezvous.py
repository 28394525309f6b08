"""The job's rendezvous keys, held by the controller and reached only over the
CURVE-authenticated link (STORE / STORE_REPLY), never through an open listener.

Each epoch's groups are formed through these keys (gloo's peer addresses, NCCL's unique
id) under a prefix of their own (`resild/e<epoch>/...`). A worker's c10d store
(`launcher.worker.links.store.LinkStore`) turns every store call into one request; a
request for a key not yet set is parked until it is set or its deadline passes, so the
controller never blocks on it.

Pure apart from the clock it is given: `handle()` and `expire()` return the replies to
send, the caller sends them.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 512 << 10  # gloo's largest value is one rank's pair addresses (~40 bytes a peer)
MAX_TOTAL_BYTES = 256 << 20  # every key of the live epochs together
MAX_PARKED = 1 << 20
KEEP_EPOCHS = 2  # the newest epochs whose keys are kept (a formation may still be under way)
MAX_WAIT_S = 3600.0
MAX_REPLY_VALUES_CHARS = 512 << 10  # a multi_get reply's base64 values, well inside a 1 MB frame

_EPOCH = re.compile(r"^resild/e(\d+)/")
OPS = ("set", "get", "add", "check", "wait", "compare_set", "delete", "num_keys", "multi_get")


def b64(v: bytes) -> str:
    return base64.b64encode(v).decode()


def unb64(s: str) -> bytes:
    return base64.b64decode(s.encode(), validate=True)


@dataclass
class Parked:
    ident: bytes
    rid: int
    op: str  # get, wait or multi_get
    keys: list[str]
    deadline: float


Reply = tuple[bytes, dict[str, Any]]


@dataclass
class Rendezvous:
    kv: dict[str, bytes] = field(default_factory=dict)
    parked: dict[str, list[Parked]] = field(default_factory=dict)  # by one key the request still waits for
    nbytes: int = 0
    newest_epoch: int = 0
    n_parked: int = 0
    next_deadline: float = float("inf")  # expire() scans nothing before this

    # ---- requests ---------------------------------------------------------------------
    def handle(self, ident: bytes, req: dict[str, Any], now: float) -> list[Reply]:
        """One STORE request (already validated as a body: id, op, keys, value, n, expected,
        timeout_s) -> the replies to send now (this one, and parked ones it released)."""
        rid, op = int(req["id"]), str(req["op"])
        keys: list[str] = list(req.get("keys") or [])
        try:
            for k in keys:
                if len(k) > MAX_KEY_CHARS:
                    raise ValueError(f"a key is longer than {MAX_KEY_CHARS} characters")
            return self._op(ident, rid, op, keys, req, now)
        except (ValueError, KeyError) as e:
            return [(ident, {"id": rid, "ok": False, "error": str(e)})]

    def _op(self, ident: bytes, rid: int, op: str, keys: list[str], req: dict[str, Any], now: float) -> list[Reply]:
        ok: dict[str, Any] = {"id": rid, "ok": True}
        if op in ("set", "add", "compare_set", "delete", "get") and len(keys) != 1:
            raise ValueError(f"{op} takes one key")
        if op == "set":
            return [(ident, ok), *self._put(keys[0], unb64(str(req.get("value") or "")))]
        if op == "add":
            total = int(self.kv.get(keys[0], b"0") or b"0") + int(req.get("n") or 0)
            return [(ident, {**ok, "n": total}), *self._put(keys[0], str(total).encode())]
        if op == "compare_set":
            expected, desired = unb64(str(req.get("expected") or "")), unb64(str(req.get("value") or ""))
            cur = self.kv.get(keys[0])
            if (cur is None and expected == b"") or cur == expected:
                return [(ident, {**ok, "value": b64(desired)}), *self._put(keys[0], desired)]
            return [(ident, {**ok, "value": b64(expected if cur is None else cur)})]
        if op == "delete":
            old = self.kv.pop(keys[0], None)
            if old is not None:
                self.nbytes -= len(old)
            return [(ident, {**ok, "n": int(old is not None)})]
        if op == "check":
            return [(ident, {**ok, "n": int(all(k in self.kv for k in keys))})]
        if op == "num_keys":
            return [(ident, {**ok, "n": len(self.kv)})]
        if op in ("get", "wait", "multi_get"):
            missing = [k for k in keys if k not in self.kv]
            if not missing:
                return [(ident, self._answer(rid, op, keys))]
            if self.n_parked >= MAX_PARKED:
                raise ValueError("too many requests waiting for keys")
            timeout_s = min(float(req.get("timeout_s") or MAX_WAIT_S), MAX_WAIT_S)
            self.parked.setdefault(missing[0], []).append(Parked(ident, rid, op, keys, now + timeout_s))
            self.n_parked += 1
            self.next_deadline = min(self.next_deadline, now + timeout_s)
            return []
        raise ValueError(f"unknown store operation {op!r}")

    def _answer(self, rid: int, op: str, keys: list[str]) -> dict[str, Any]:
        if op == "get":
            return {"id": rid, "ok": True, "value": b64(self.kv[keys[0]])}
        if op == "multi_get":  # the first keys' values that fit one reply (always one): the caller asks for the rest
            values: list[str] = []
            size = 0
            for k in keys:
                v = b64(self.kv[k])
                size += len(v)
                if values and size > MAX_REPLY_VALUES_CHARS:
                    break
                values.append(v)
            return {"id": rid, "ok": True, "values": values}
        return {"id": rid, "ok": True}

    def _put(self, key: str, value: bytes) -> list[Reply]:
        if len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a value of {len(value)} bytes is over the {MAX_VALUE_BYTES}-byte limit")
        m = _EPOCH.match(key)
        if m is not None and int(m.group(1)) > self.newest_epoch:
            self.newest_epoch = int(m.group(1))
            self._forget_old_epochs()
        old = self.kv.get(key)
        grow = len(value) - (len(old) if old is not None else 0)
        if self.nbytes + grow > MAX_TOTAL_BYTES:
            raise ValueError(f"the rendezvous keys would hold more than {MAX_TOTAL_BYTES} bytes")
        self.kv[key] = value
        self.nbytes += grow
        return self._release(key)

    def _release(self, key: str) -> list[Reply]:
        out: list[Reply] = []
        for p in self.parked.pop(key, []):
            self.n_parked -= 1
            missing = [k for k in p.keys if k not in self.kv]
            if missing:  # park again on the next key it lacks
                self.parked.setdefault(missing[0], []).append(p)
                self.n_parked += 1
            else:
                out.append((p.ident, self._answer(p.rid, p.op, p.keys)))
        return out

    def _forget_old_epochs(self) -> None:
        """Keys of epochs older than the newest KEEP_EPOCHS are never read again."""
        floor = self.newest_epoch - KEEP_EPOCHS + 1
        for k in [k for k in self.kv if (m := _EPOCH.match(k)) is not None and int(m.group(1)) < floor]:
            self.nbytes -= len(self.kv.pop(k))

    # ---- the tick -----------------------------------------------------------------------
    def expire(self, now: float) -> list[Reply]:
        """Parked requests past their deadline, answered with an error (the worker's store
        call raises, and the formation it was part of fails and is retried)."""
        if now < self.next_deadline:
            return []
        out: list[Reply] = []
        self.next_deadline = float("inf")
        for key in list(self.parked):
            keep = [p for p in self.parked[key] if p.deadline > now]
            for p in self.parked[key]:
                if p.deadline <= now:
                    out.append((p.ident, {"id": p.rid, "ok": False, "error": f"timed out waiting for {key!r}"}))
            self.n_parked -= len(self.parked[key]) - len(keep)
            if keep:
                self.parked[key] = keep
                self.next_deadline = min(self.next_deadline, min(p.deadline for p in keep))
            else:
                del self.parked[key]
        return out
