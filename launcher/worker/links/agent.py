"""Registers this training process with the node's resild daemon and reports its
step, so the daemon's process watch (exit, zombie, no progress) covers it.

Best effort and off the hot path: a background thread with its own socket; a
missing or slow daemon never slows or breaks training.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import zmq

import resild.wire.env as resild_env
from resild.wire.local_socket import local_request
from resild.wire.protocol import MsgType

log = logging.getLogger("resild.agent_link")
DEFAULT_SOCKET = "/run/resild/status.sock"


def agent_endpoint(env: Mapping[str, str] = os.environ) -> str | None:
    """$RESILD_AGENT_SOCKET, else the daemon's default socket if it exists."""
    path = env.get(resild_env.AGENT_SOCKET.name) or (DEFAULT_SOCKET if os.path.exists(DEFAULT_SOCKET) else None)
    if not path:
        return None
    return path if "://" in path else f"ipc://{path}"


class AgentLink:
    def __init__(
        self, endpoint: str, name: str, step: Callable[[], int], interval_s: float = 1.0, timeout_s: float = 1.0
    ) -> None:
        self.endpoint, self.name, self.step = endpoint, name, step
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resild-agent-link", daemon=True)

    def start(self) -> AgentLink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1.0)

    def _request(self, ctx: zmq.Context[Any], mtype: MsgType, body: dict[str, Any]) -> bool:
        reply = local_request(self.endpoint, mtype, body, timeout_s=self.timeout_s, ctx=ctx)
        return reply is not None and reply.type != MsgType.ERROR

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            registered, last = False, None
            while not self._stop.is_set():
                if not registered:
                    registered = self._request(ctx, MsgType.REGISTER_WORKER, {"pid": os.getpid(), "name": self.name})
                else:
                    step = self.step()
                    if step != last:  # progress only when the step moved: silence means a hang
                        if not self._request(ctx, MsgType.PROGRESS, {"pid": os.getpid(), "step": step}):
                            registered = False  # daemon restarted: register again
                        last = step
                self._stop.wait(self.interval_s)
        finally:
            ctx.term()
