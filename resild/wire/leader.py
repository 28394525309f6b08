"""Following the controller's leader: one endpoint per replica, heartbeats to all, requests to the leader."""

from __future__ import annotations

from typing import Any

import zmq
import zmq.auth

from resild.wire.channel import connect
from resild.wire.keys import KeyDir
from resild.wire.protocol import Message, MsgType


class ControllerSet:
    """A peer's links to the controller replicas, one DEALER per endpoint (the same list,
    in the same order, everywhere). The leader is the replica that last spoke with the
    highest lease term: standbys never send, and a deposed leader's older term is
    ignored. Until a leader has spoken, sends go to every replica (only the leader acts
    on them); with one endpoint it is the leader from the start."""

    def __init__(self, ctx: zmq.SyncContext, endpoints: list[str], keys: KeyDir | None, sender: str) -> None:
        if not endpoints or not all(endpoints):
            raise ValueError("no controller endpoint given")
        self.endpoints = list(endpoints)
        self.chans = [connect(ctx, ep, keys, sender) for ep in self.endpoints]
        self.leader: int | None = 0 if len(self.chans) == 1 else None
        self.term = 0

    @property
    def socks(self) -> list[zmq.SyncSocket]:
        return [c.sock for c in self.chans]

    @property
    def leader_endpoint(self) -> str:
        return self.endpoints[self.leader] if self.leader is not None else ",".join(self.endpoints)

    def send(self, mtype: MsgType, body: dict[str, Any] | None = None, *, ttl_s: float | None = None) -> None:
        for c in [self.chans[self.leader]] if self.leader is not None else self.chans:
            c.send(mtype, body, ttl_s=ttl_s)

    def send_all(self, mtype: MsgType, body: dict[str, Any] | None = None, *, ttl_s: float | None = None) -> None:
        """Liveness and registration: a standby that takes over knows its peers at once."""
        for c in self.chans:
            c.send(mtype, body, ttl_s=ttl_s)

    def send_standbys(self, mtype: MsgType, body: dict[str, Any] | None = None, *, ttl_s: float | None = None) -> None:
        """Every replica but the leader (all of them while no leader is known)."""
        for i, c in enumerate(self.chans):
            if i != self.leader:
                c.send(mtype, body, ttl_s=ttl_s)

    def follow(self, term: int, leader: int) -> bool:
        """A lease of `term` naming replica `leader`: True when this is a new leader (or a
        restarted one) that must be told who we are again."""
        if term <= self.term or not 0 <= leader < len(self.chans):
            return False
        # The first leader heard our registration (sent to every replica): nothing to repeat.
        new = self.term > 0 or (self.leader is not None and self.leader != leader)
        self.term, self.leader = term, leader
        return new

    def recv(self, index: int) -> Message | None:
        """The next message from replica `index` that counts: from the leader, or a lease
        with a newer term (the caller follows it); anything else is dropped. The first
        replica to speak is the leader until a lease says otherwise."""
        while (got := self.chans[index].recv(0)) is not None:
            msg = got[1]
            if self.leader is None:
                self.leader = index
            if index == self.leader or (msg.type == MsgType.LEASE and int(msg.body.get("term", 0)) > self.term):
                return msg
        return None

    @property
    def monitors(self) -> list[zmq.SyncSocket]:
        """Each link's connection events, for a poller: a drop is handled when it happens."""
        return [c.monitor for c in self.chans if c.monitor is not None]

    def renewed(self) -> bool:
        """Read every link's connection events; True when the leader's link (any link while
        no leader is known) was connected again under a fresh routing id since the last
        call: the leader never heard the new one, and what it sent to the old is lost, so
        whoever registered must say so again."""
        hit = False
        for i, c in enumerate(self.chans):
            before = c.renewals
            c.link_events()
            if c.renewals != before and (self.leader is None or i == self.leader):
                hit = True
        return hit

    def index_of(self, sock: Any) -> int | None:
        for i, c in enumerate(self.chans):
            if c.sock is sock:
                return i
        return None

    def close(self, linger_ms: int = 0) -> None:
        for c in self.chans:
            c.close(linger_ms)
