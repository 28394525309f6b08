"""Epochs and leases, from the controller to node processes and direct workers.

Frames are encoded once and sent without blocking (a peer whose queue is full misses a
frame; membership is asked for again by its heartbeat, a lease comes again next
interval). An epoch costs O(ranks) once: node processes holding the previous epoch
get one few-byte delta frame, the others their node's view (its ranks, the world
size), and only workers not behind their node's relay get the full layout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import zmq

from resild.controller.view import ClusterView, NodeView
from resild.membership import Membership, NodeRole
from resild.wire.channel import Channel
from resild.wire.protocol import MAX_FRAME_BYTES, Message, MsgType, encode

log = logging.getLogger("resild.controller")


def _json(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Announced:
    """How an epoch went out: node views, delta frames, full layouts to direct workers."""

    view: int
    delta: int
    direct: int
    layout: dict[str, Any]  # the epoch's to_dict(), made once


class Broadcaster:
    def __init__(self, ch: Channel, view: ClusterView, nproc: int) -> None:
        self.ch, self.view, self.nproc = ch, view, nproc
        # Who to reach: node processes by node, direct workers by (node, local rank).
        self.node_ident: dict[str, bytes] = {}
        self.worker_ident: dict[tuple[str, int], bytes] = {}
        self.full_json = b""  # the current membership's full layout, encoded once per epoch
        self.welcome_json = b""

    def set_layout(self, m: Membership) -> None:
        self.full_json = _json(m.to_dict())

    def announce(self, m: Membership, prev: Membership | None, now: float) -> Announced:
        """Epoch `m` to every node process holding ranks in it, and to its direct workers.
        Encoded once: one delta frame for every node holding the previous epoch, one
        full-layout frame for every direct worker (one seq each, made just before its
        first send, so every receiver still sees our seqs rise)."""
        layout = m.to_dict()
        self.full_json = _json(layout)
        full = b""
        delta = m.delta_from(prev) if prev is not None else None
        delta_frame = self.frame(MsgType.MEMBERSHIP_DELTA, _json(delta)) if delta is not None else b""
        n_view = n_delta = n_direct = 0
        for node_id in m.node_ranks:
            node = self.view.nodes[node_id]
            ident = self.node_ident.get(node_id)
            if ident is not None:
                if delta is not None and prev is not None and node.epoch_sent == prev.epoch:
                    self.send_raw(ident, delta_frame)
                    node.epoch_sent, node.membership_sent_s = m.epoch, now
                    n_delta += 1
                else:
                    self.send_view(node, ident, now)
                    n_view += 1
            if len(node.relayed) < self.nproc:  # workers not behind the node's relay: directly
                for lr in range(self.nproc):
                    if lr not in node.relayed and (wid := self.worker_ident.get((node_id, lr))) is not None:
                        full = full or self.frame(MsgType.MEMBERSHIP, self.full_json)
                        self.send_raw(wid, full)
                        n_direct += 1
        return Announced(n_view, n_delta, n_direct, layout)

    def send_view(self, node: NodeView, ident: bytes, now: float) -> None:
        """A node process's own view of the epoch: O(its ranks), not O(world)."""
        m = self.view.membership
        assert m is not None
        self.send_raw(ident, self.frame(MsgType.MEMBERSHIP, _json(m.view(node.node_id).to_dict())))
        node.epoch_sent, node.membership_sent_s = m.epoch, now

    def send_layout(self, ident: bytes) -> None:
        """The full layout of the current epoch, to a worker not behind its node's relay."""
        self.send_raw(ident, self.frame(MsgType.MEMBERSHIP, self.full_json))

    def frame(self, mtype: MsgType, body_json: bytes, ttl_s: float = 600.0) -> bytes:
        """A frame around an already-encoded body: the envelope is made by the protocol
        module (fresh seq and deadline), the body is spliced in, not re-serialised."""
        msg = self.ch.seq.make(mtype, None, ttl_s)
        head = encode(msg)
        if head.endswith(b'"body":{}}'):
            return head[:-3] + body_json + b"}"
        return encode(Message(msg.type, msg.sender, msg.seq, msg.deadline, json.loads(body_json)))

    def send_raw(self, ident: bytes, frame: bytes) -> None:
        if len(frame) > MAX_FRAME_BYTES:  # ~130k ranks of layout: the peer would drop the connection
            log.error("not sending a %d-byte frame (limit %d)", len(frame), MAX_FRAME_BYTES)
            return
        try:
            self.ch.sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("send dropped: peer queue full")  # membership: the node's heartbeat asks again

    # ---- leases -----------------------------------------------------------------------
    def lease_frame(self, term: int, leader: int, interval_s: float, timeout_s: float, store: str) -> bytes:
        body = {
            "term": term,
            "leader": leader,
            "interval_s": round(interval_s, 3),
            "timeout_s": round(timeout_s, 3),  # how long the node waits for the next (JobSettings.for_nodes)
            "store": store,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        return self.frame(MsgType.LEASE, _json(body), ttl_s=60.0)

    def send_leases(self, term: int, leader: int, interval_s: float, timeout_s: float, store: str) -> None:
        """One frame, encoded once per interval, to every node process still in the job."""
        frame = b""
        for node_id, ident in self.node_ident.items():
            if self.view.nodes[node_id].role in (NodeRole.ACTIVE, NodeRole.SPARE):
                frame = frame or self.lease_frame(term, leader, interval_s, timeout_s, store)
                self.send_raw(ident, frame)
