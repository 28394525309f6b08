"""Epochs and leases, from the controller to node processes and direct workers.

Frames are encoded once and sent without blocking (a peer whose queue is full misses a
frame; membership is asked for again by its heartbeat, a lease comes again next
interval). An epoch costs two sends per node and O(moves) of encoding: node processes
holding the previous epoch get the same few-byte delta frame, the others their node's
view (its ranks, the world size); only workers not behind their node's relay get the
full layout (O(ranks), encoded once per epoch when one needs it).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass

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
    seconds: float = 0.0  # the controller's time to send it (set by its caller)
    cpu_s: float = 0.0


# Plain ints: `zmq.NOBLOCK | zmq.SNDMORE` is an enum operation, and pyzmq's send_multipart
# does it for every part: at 2,000 nodes that was half of the announcement's Python time.
_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)
_LAST = int(zmq.NOBLOCK)


class Broadcaster:
    def __init__(self, ch: Channel, view: ClusterView, nproc: int) -> None:
        self.ch, self.view, self.nproc = ch, view, nproc
        # Who to reach: node processes by node, direct workers by (node, local rank).
        self.node_ident: dict[str, bytes] = {}
        self.worker_ident: dict[tuple[str, int], bytes] = {}
        self.welcome_json: dict[str, bytes] = {}  # by the registering node's role: encoded once per job
        self._layout: Membership | None = None  # the current epoch, for direct workers
        self._full_json = b""  # its full layout, encoded on first use (none: no direct worker)

    def set_layout(self, m: Membership) -> None:
        self._layout, self._full_json = m, b""

    @property
    def full_json(self) -> bytes:
        """The current epoch's full layout, encoded once per epoch, and only if a worker
        not behind its node's relay needs it: O(ranks), never on the common path."""
        if not self._full_json and self._layout is not None:
            self._full_json = _json(self._layout.to_dict())
        return self._full_json

    def announce(self, m: Membership, prev: Membership | None, now: float) -> Announced:
        """Epoch `m` to every node process holding ranks in it, and to its direct workers.

        First the views (nodes new to the layout: the spare, which has the most to do,
        and nodes that missed an epoch), then one delta frame, encoded once, as the same
        bytes to every node holding the previous epoch: the per-node work is two sends.
        Direct workers get one full-layout frame. (Each frame's seq is made just before
        its first send, so every receiver still sees our seqs rise.)"""
        self.set_layout(m)
        delta = m.delta_from(prev) if prev is not None else None
        base = prev.epoch if prev is not None and delta is not None else -1
        nodes, idents, nproc, epoch = self.view.nodes, self.node_ident, self.nproc, m.epoch
        n_view = n_delta = n_direct = 0
        for node_id in delta["moves"].values() if delta is not None else ():
            ident = idents.get(node_id)
            if ident is not None:
                self.send_view(nodes[node_id], ident, now)
                n_view += 1
        frame = self.frame(MsgType.MEMBERSHIP_DELTA, _json(delta)) if delta is not None else b""
        if len(frame) > MAX_FRAME_BYTES:  # never at any real size: a delta names its moves only
            log.error("not sending a %d-byte delta (limit %d): views instead", len(frame), MAX_FRAME_BYTES)
            base = -1
        send = self.ch.sock.send
        direct: list[NodeView] = []
        for node_id in m.node_ranks:
            node = nodes[node_id]
            if len(node.relayed) < nproc:
                direct.append(node)
            sent = node.epoch_sent
            if sent == epoch or (ident := idents.get(node_id)) is None:
                continue
            if sent == base:
                try:
                    send(ident, _MORE)
                    send(frame, _LAST)
                except zmq.Again:  # its heartbeat asks again (the resync)
                    continue
                node.epoch_sent, node.membership_sent_s = epoch, now
                n_delta += 1
            else:
                self.send_view(node, ident, now)
                n_view += 1
        full = b""
        for node in direct:  # workers not behind the node's relay: the full layout directly
            for lr in range(nproc):
                if lr not in node.relayed and (wid := self.worker_ident.get((node.node_id, lr))) is not None:
                    full = full or self.frame(MsgType.MEMBERSHIP, self.full_json)
                    self.send_raw(wid, full)
                    n_direct += 1
        return Announced(n_view, n_delta, n_direct)

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
            self.ch.sock.send(ident, _MORE)
            self.ch.sock.send(frame, _LAST)
        except zmq.Again:
            log.debug("send dropped: peer queue full")  # membership: the node's heartbeat asks again

    # ---- leases -----------------------------------------------------------------------
    def lease_frame(self, term: int, leader: int, interval_s: float, timeout_s: float) -> bytes:
        body = {
            "term": term,
            "leader": leader,
            "interval_s": round(interval_s, 3),
            "timeout_s": round(timeout_s, 3),  # how long the node waits for the next (JobSettings.for_nodes)
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        return self.frame(MsgType.LEASE, _json(body), ttl_s=60.0)

    def send_leases(self, term: int, leader: int, interval_s: float, timeout_s: float) -> None:
        """One frame, encoded once per interval, to every node process still in the job."""
        frame = b""
        for node_id, ident in self.node_ident.items():
            if self.view.nodes[node_id].role in (NodeRole.ACTIVE, NodeRole.SPARE):
                frame = frame or self.lease_frame(term, leader, interval_s, timeout_s)
                self.send_raw(ident, frame)
