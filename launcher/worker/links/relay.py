"""The worker's end of the node-local relay (`launcher.node.relay` is the node's end):
the membership layouts the node process hands its workers, over an ipc:// socket.

    worker: RelayClient(os.environ["RESILD_RELAY"], sender)  --RELAY_HELLO-->  node: RelayServer
            <-- MEMBERSHIP (a layout, never a delta; again on every hello) --
"""

from __future__ import annotations

import os
import time
from typing import Any

import zmq

import resild.wire.env as resild_env
from resild.wire.channel import Channel
from resild.wire.protocol import Message, MsgType


class RelayClient:
    """The worker's end. `sock` can sit in the worker's zmq.Poller; `recv(0)` never blocks.

    Messages received are MEMBERSHIP (a layout for Membership.from_dict, never a
    delta: the node's view, which names this node's ranks and the world size; a
    worker needs `rank_of(node, local_rank)`, `world_size` and `epoch`) and SHUTDOWN.
    On connect it says hello, and the node answers with the current membership, so a
    worker that starts (or reconnects) late is never behind."""

    def __init__(
        self, endpoint: str, sender: str, local_rank: int | None = None, ctx: zmq.Context[Any] | None = None
    ) -> None:
        if local_rank is None:
            local_rank = int(os.environ.get(resild_env.LOCAL_RANK.name, "-1"))
        self.node = os.environ.get(resild_env.NODE.name, sender.split("/", 1)[0])
        sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.IDENTITY, sender)
        sock.connect(endpoint)
        self.sock = sock
        self.ch = Channel(sock, sender, router=False)
        self.ch.send(MsgType.RELAY_HELLO, {"node": self.node, "local_rank": local_rank, "pid": os.getpid()})

    def recv(self, timeout_s: float) -> Message | None:
        got = self.ch.recv(timeout_s)
        return got[1] if got is not None else None

    def send(self, mtype: MsgType, body: dict[str, Any], ttl_s: float | None = None) -> None:
        self.ch.send(mtype, body, ttl_s=ttl_s)

    def close(self) -> None:
        if not self.sock.closed:
            self.sock.close(linger=500)  # let a last report out


def wait_for(client: RelayClient, mtype: MsgType, timeout_s: float) -> Message | None:
    """Receive until a message of `mtype` arrives (tests and simple callers)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        msg = client.recv(left)
        if msg is not None and msg.type == mtype:
            return msg
    return None
