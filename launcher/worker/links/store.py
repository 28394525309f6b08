"""The worker's c10d store: every call is one request to the controller over the
worker's CURVE-authenticated link (`ControlLink.request`), answered from the
controller's rendezvous keys (`resild.rendezvous`). No store listener is
left open in a job: a local user who can reach the node's ports can neither read the
peers' addresses nor write a key. Behind a relay the request goes to the node process
first, which serves a node-local group's keys itself (`node_local=True`) and forwards the
rest (launcher/node/node_store.py).

torch calls these methods from C++ (gloo's and NCCL's rendezvous, in the thread that
forms a group) through its Python-store trampoline; the object must stay referenced
from Python for as long as any group may use it (the runtime keeps one for the job).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

Request = Callable[[dict[str, Any], float, bool], dict[str, Any]]
MAX_KEYS = 128  # per multi_get request (the wire takes 256 keys; gloo asks for 128 at a time)


def _b64(v: bytes | str) -> str:
    return base64.b64encode(v.encode() if isinstance(v, str) else bytes(v)).decode()


class LinkStore(dist.Store):
    def __init__(self, request: Request, timeout_s: float, node_local: bool = False) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._request, self.timeout_s, self.node_local = request, timeout_s, node_local

    def _call(self, op: str, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        t = self.timeout_s if timeout_s is None else timeout_s
        reply = self._request({"op": op, **body}, t, self.node_local)
        if not reply.get("ok"):
            raise RuntimeError(f"resild store {op}: {reply.get('error') or 'refused'}")
        return reply

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", keys=[key], value=_b64(value))

    def get(self, key: str) -> bytes:
        return base64.b64decode(self._call("get", keys=[key])["value"])

    def has_extended_api(self) -> bool:
        return True  # multi_get: gloo reads every peer's address in one request

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Every key's value once all are set: one request for up to MAX_KEYS keys, answered
        with the values that fit one reply (the rest are asked for again)."""
        out: list[bytes] = []
        keys = list(keys)
        while keys:
            reply = self._call("multi_get", keys=keys[:MAX_KEYS])
            values = [base64.b64decode(v) for v in reply["values"]]
            if not values:
                raise RuntimeError("resild store multi_get: an empty answer")
            out += values
            keys = keys[len(values) :]
        return out

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", keys=[key], n=int(amount))["n"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return base64.b64decode(
            self._call("compare_set", keys=[key], expected=_b64(expected), value=_b64(desired))["value"]
        )

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=list(keys))["n"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        t = self.timeout_s if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        self._call("wait", timeout_s=t, keys=list(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", keys=[key])["n"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")["n"])
