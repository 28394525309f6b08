"""The worker's link to the controller: one background thread owns the sockets.

It turns controller messages into state the training thread reads at its own
points (a newer membership, a fault to inject, the end of the job) and never
raises from inside a handler. A newer epoch latches an error on `Interrupts`,
which releases every collective wait at once, including waits inside C++ (DDP's
reducer waits on our futures). It also tells the controller when this rank has
been blocked in a collective for a while, so the hang detector blames the rank
that is *not* waiting.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

import resild.wire.env as resild_env
from launcher.worker.stable_group import Interrupts
from resild.membership import Membership
from resild.wire.exits import FENCED_EXIT
from resild.wire.keys import KeyDir
from resild.wire.leader import ControllerSet
from resild.wire.protocol import MsgType
from resild.wire.settings import WorkerTimeouts

log = logging.getLogger("resild.control")
COMMIT_REPORT_S = 0.1  # while commits flow, the newest goes out this often (not one wake per step)


class ControlLink:
    def __init__(
        self,
        controller: str,
        keys: KeyDir | None,
        node: str,
        local_rank: int,
        intr: Interrupts,
        status: Callable[[], tuple[int, int, int]],
    ) -> None:
        self.controller, self.node, self.local_rank = controller, node, local_rank
        self.intr, self._status = intr, status
        self.ctx = zmq.Context()
        self._keys = keys
        self._out: queue.Queue[tuple[MsgType, dict[str, Any], float | None]] = queue.Queue()  # (type, body, ttl)
        # A commit report replaces the one not yet sent instead of waking the thread every
        # step: the thread looks every COMMIT_REPORT_S while commits flow (the node process
        # aggregates at that rate anyway). The lock keeps the order: a pending commit goes
        # into the queue before any later message.
        self._out_lock = threading.Lock()
        self._commit: dict[str, Any] | None = None
        self._commit_polling = False  # the thread is looking every COMMIT_REPORT_S: no wake needed
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        # Read by the training thread; written only here, under intr.cond.
        self.welcome: dict[str, Any] | None = None
        self.pending: Membership | None = None  # newest membership not yet taken
        self.epoch = 0  # the epoch the training thread works in
        # The membership of that epoch (the last taken): its committed floor is what a
        # recovery into it must find (never read from the store, which anyone can write).
        self.current: Membership | None = None
        self.inject_exception = False
        self.inject_corrupt = False  # damage every snapshot copy this rank holds (tests the checksums)
        self.inject_diverge = False  # nudge one parameter (tests the replicas' fingerprints)
        self.inject_badgrad = False  # wrong gradients for one step (tests --verify-every)
        self.inject_slow_pct = 0  # every step this share slower from now on (tests stragglers)
        self.shutdown: dict[str, Any] | None = None
        self.wait_report_s = WorkerTimeouts.from_welcome({}).wait_report_s
        # Told again to a new leader (standby takeover): who we are, and that we are done.
        self._repeat: dict[MsgType, dict[str, Any]] = {}
        self._progress_seq = 0  # PROGRESS reports given so far (any thread)
        self._wait_seq = 0  # ... when the link last reported this rank blocked
        self._ch: ControllerSet | None = None
        # Store requests in flight (LinkStore), by id: answered by STORE_REPLY, or failed
        # when the leader changes (its successor never saw them).
        self._req_lock = threading.Lock()
        self._req_next = 0
        self._requests: dict[int, list[Any]] = {}  # id -> [Event, reply or None]
        # With a node process relaying (RESILD_RELAY), store requests go to it: it serves the
        # node-local groups' keys itself and forwards the rest (launcher/node/node_store.py).
        self.via_relay = bool(os.environ.get(resild_env.RELAY.name))
        self._thread = threading.Thread(target=self._run, name="resild-control", daemon=True)

    def start(self) -> ControlLink:
        self._thread.start()
        return self

    # ---- called from any thread ------------------------------------------------
    def send(self, mtype: MsgType, **body: Any) -> None:
        if mtype == MsgType.PROGRESS:
            self._progress_seq += 1
        if mtype in (MsgType.REGISTER_WORKER, MsgType.DONE):
            self._repeat[mtype] = {"node": self.node, **body}
        elif mtype == MsgType.PROGRESS and body.get("state") != "commit":
            # A rank blocked (or joining) when the leader changes must say so again, or the
            # new leader's hang detector would blame it; anything else clears that.
            if body.get("state") in ("wait", "collective_failed", "join", "checkpoint"):
                self._repeat[mtype] = {"node": self.node, **body}
            else:
                self._repeat.pop(mtype, None)
        elif mtype == MsgType.PROGRESS:  # a commit: the newest replaces one not yet sent
            with self._out_lock:
                self._commit = {"node": self.node, **body}
                wake = not self._commit_polling
            if wake:
                os.write(self._wake_w, b"x")
            return
        self._enqueue(mtype, {"node": self.node, **body})

    def _enqueue(self, mtype: MsgType, body: dict[str, Any], ttl_s: float | None = None) -> None:
        with self._out_lock:
            if self._commit is not None:  # an earlier commit leaves first
                self._out.put((MsgType.PROGRESS, self._commit, None))
                self._commit = None
            self._out.put((mtype, body, ttl_s))
        os.write(self._wake_w, b"x")

    def _next_out(self) -> tuple[MsgType, dict[str, Any], float | None] | None:
        """The next message to send, in the order they were given; the pending commit last."""
        with self._out_lock:
            try:
                return self._out.get_nowait()
            except queue.Empty:
                pass
            commit, self._commit = self._commit, None
            return None if commit is None else (MsgType.PROGRESS, commit, None)

    def request(self, body: dict[str, Any], timeout_s: float, node_local: bool = False) -> dict[str, Any]:
        """One STORE request (to the node process with a relay, else to the leader); its reply
        body. `node_local`: for a group whose ranks all live on this node. Raises TimeoutError
        past the deadline, ConnectionError when the leader changed or the link closed meanwhile."""
        if self.via_relay:
            body = {**body, "scope": "node" if node_local else "job"}
        slot: list[Any] = [threading.Event(), None]
        with self._req_lock:
            self._req_next += 1
            rid = self._req_next
            self._requests[rid] = slot
        try:
            # Lives as long as its own timeout: a backlogged controller must still answer it
            # (an expired frame is dropped unanswered, and the formation would wait it out).
            self._enqueue(
                MsgType.STORE, {"node": self.node, "id": rid, "timeout_s": timeout_s, **body}, timeout_s + 1.0
            )
            if not slot[0].wait(timeout_s + 1.0):
                raise TimeoutError(f"no answer from the controller to store {body.get('op')} in {timeout_s:.0f}s")
        finally:
            with self._req_lock:
                self._requests.pop(rid, None)
        reply: dict[str, Any] | None = slot[1]
        if reply is None:
            raise ConnectionError("the controller changed or the link closed during a store request")
        return reply

    def _answer_requests(self, reply: dict[str, Any] | None) -> None:
        """Release one request (a STORE_REPLY), or all of them with no answer (None)."""
        with self._req_lock:
            if reply is None:
                slots = list(self._requests.values())
                self._requests.clear()
            else:
                got = self._requests.get(int(reply.get("id", -1)))
                slots = [got] if got is not None else []
        for slot in slots:
            slot[1] = reply
            slot[0].set()

    def take(self) -> Membership | None:
        with self.intr.cond:
            m, self.pending = self.pending, None
            if m is not None:
                self.epoch, self.current = m.epoch, m
            return m

    def newer_epoch(self) -> bool:
        p = self.pending
        return p is not None and p.epoch > self.epoch

    def wait(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.intr.cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.intr.cond.wait(min(left, 0.5))
            return True

    def close(self, flush_s: float = 1.0) -> None:
        """Stop the thread after sending what is queued (a FAILED report must leave)."""
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._stopped.wait(flush_s + 1.0)

    # ---- the thread ------------------------------------------------------------
    def _run(self) -> None:
        ch = self._ch = ControllerSet(
            self.ctx, self.controller.split(","), self._keys, sender=f"{self.node}/w{self.local_rank}/{os.getpid()}"
        )
        relay = None
        if os.environ.get(resild_env.RELAY.name):
            from launcher.worker.links.relay import (
                RelayClient,  # the node process relays membership and aggregates progress
            )

            relay = RelayClient(os.environ[resild_env.RELAY.name], f"{self.node}/w{self.local_rank}")
        poller = zmq.Poller()
        for sock in ch.socks + ch.monitors:
            poller.register(sock, zmq.POLLIN)
        if relay is not None:
            poller.register(relay.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        reported = False
        try:
            while True:
                committed = self._flush(ch, relay)
                if self._stop.is_set():
                    break
                with self._out_lock:  # commits flowing: look again soon, unasked; else sleep until woken
                    # (one given since the flush was not woken for: it is looked for soon too)
                    polling = self._commit_polling = committed or self._commit is not None
                sleep_s = report_poll_s(self.intr.oldest_in_flight_s(time.monotonic()), reported, self.wait_report_s)
                if polling:
                    sleep_s = min(sleep_s, COMMIT_REPORT_S)
                ready = dict(poller.poll(max(1, int(sleep_s * 1000))))
                if ready.get(self._wake_r):
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                for i, sock_ in enumerate(ch.socks):
                    if ready.get(sock_):
                        while (msg := ch.recv(i)) is not None:
                            self._on_message(msg)
                if ch.renewed():  # our link to the leader dropped: it must hear us again
                    self._register_again()
                while relay is not None and ready.get(relay.sock):
                    msg = relay.recv(0)
                    if msg is None:
                        break
                    self._on_message(msg)
                reported = self._report_wait(reported)
        except Exception:  # the link must never take the trainer down silently
            log.exception("control link failed")
            self.intr.fail("control link failed")
        finally:
            self._flush(ch, relay)
            self._answer_requests(None)
            ch.close(linger_ms=1000)
            if relay is not None:
                relay.close()
            self._stopped.set()

    def _flush(self, ch: Any, relay: Any) -> bool:
        """Send everything given so far; -> whether a commit report was among it."""
        committed = False
        while True:
            item = self._next_out()
            if item is None:
                return committed
            mtype, body, ttl_s = item
            committed = committed or (mtype == MsgType.PROGRESS and body.get("state") == "commit")
            if relay is not None and mtype in (MsgType.PROGRESS, MsgType.STORE):  # STORE: see request()
                relay.send(mtype, body, ttl_s=ttl_s)
            else:
                ch.send(mtype, body, ttl_s=ttl_s)

    def _report_wait(self, reported: bool) -> bool:
        # The rule is report_poll_s's: the thread must wake by the time a report falls due.
        blocked_s = self.intr.oldest_in_flight_s(time.monotonic())
        if not reported and blocked_s > self.wait_report_s:
            rank, epoch, step = self._status()
            self.send(MsgType.PROGRESS, rank=rank, epoch=epoch, step=step, state="wait")
            self._wait_seq = self._progress_seq
            return True
        if reported and blocked_s == 0.0:
            # Said only if the trainer said nothing since: its own report (a commit, or
            # "checkpoint" at the end of the job) already replaced the wait, and a late
            # "compute" would take its excuse away from the hang detector.
            if self._progress_seq == self._wait_seq:
                rank, epoch, step = self._status()
                self.send(MsgType.PROGRESS, rank=rank, epoch=epoch, step=step, state="compute")
            return False
        return reported

    def _register_again(self) -> None:
        """A new leader, or a new connection to ours: neither knows this worker's routing
        id, and requests in flight are lost (the formation retries)."""
        self._answer_requests(None)
        with self._out_lock:  # in order with what send() queues meanwhile
            for mtype, body in list(self._repeat.items()):  # register again (a copy: send() may add)
                self._out.put((mtype, body, None))

    def _on_message(self, msg: Any) -> None:
        t = msg.type
        if t == MsgType.FENCE:
            os._exit(FENCED_EXIT)  # a fenced rank must never take part again
        if t == MsgType.STORE_REPLY:
            self._answer_requests(msg.body)
            return
        if t == MsgType.LEASE:  # from our node process: a new controller leads
            ch = self._ch
            if ch is not None and ch.follow(int(msg.body.get("term", 0)), int(msg.body.get("leader", 0))):
                self._register_again()
            return
        with self.intr.cond:
            if t == MsgType.WELCOME:
                self.welcome = msg.body
                self.wait_report_s = WorkerTimeouts.from_welcome(msg.body).wait_report_s
            elif t == MsgType.MEMBERSHIP:
                try:
                    m: Membership | None = Membership.from_dict(msg.body)
                except ValueError as e:  # a floor that is not a step: ours is a bug, never the trainer's end
                    log.error("membership refused: %s", e)
                    m = None
                newest = max(self.epoch, self.pending.epoch if self.pending else 0)
                if m is not None and m.epoch > newest:
                    self.pending = m
            elif t == MsgType.INJECT and msg.body.get("kind") == "exception":
                self.inject_exception = True
            elif t == MsgType.INJECT and msg.body.get("kind") == "corrupt":
                self.inject_corrupt = True
            elif t == MsgType.INJECT and msg.body.get("kind") == "diverge":
                self.inject_diverge = True
            elif t == MsgType.INJECT and msg.body.get("kind") == "badgrad":
                self.inject_badgrad = True
            elif t == MsgType.INJECT and msg.body.get("kind") == "slow":
                pct = msg.body.get("pct")
                self.inject_slow_pct = pct if isinstance(pct, int) and not isinstance(pct, bool) and pct > 0 else 50
            elif t == MsgType.SHUTDOWN:
                self.shutdown = msg.body
            elif t == MsgType.ERROR:
                log.error("controller error: %s", msg.body)
            self.intr.cond.notify_all()
        if t == MsgType.MEMBERSHIP and self.pending is not None and self.pending.epoch > self.epoch > 0:
            self.intr.fail(f"epoch {self.pending.epoch} announced")  # release every wait of the old epoch
        if t == MsgType.SHUTDOWN and int(msg.body.get("exit_code", 1)) != 0:
            self.intr.fail("job stopped by the controller")


def keys_from_env() -> KeyDir | None:
    keys = os.environ.get(resild_env.KEYS.name)
    return KeyDir(Path(keys)) if keys else None


def report_poll_s(blocked_s: float, reported: bool, wait_report_s: float) -> float:
    """How long the link's thread may sleep (it wakes at once for a send or a message) before
    a wait report could fall due. A collective not yet in flight cannot be blocked for
    `wait_report_s` before that long from now; one in flight is due at its age's
    complement; a reported wait is looked at every 0.1 s, to say when it clears. A fixed
    50 ms poll woke every trainer 20 times a second for nothing (issue 17)."""
    if reported:
        return 0.1
    left_s = wait_report_s - blocked_s if blocked_s > 0 else wait_report_s
    return min(1.0, max(0.01, left_s + 0.005))
