"""The controller: the only place where decisions are made. This module is its run
loop: construction, the loop over a ROUTER socket, the tick, dispatch.

Single-threaded. Every message handler (handlers.py) updates the ClusterView;
decisions come from `policy` (pure) and are journaled before the I/O that carries
them out (effects.py). The handlers and the effects share one ControllerState
(state.py); taking over from a journal is a fold (restore.py).

Cost model (it has to hold at 16k ranks): every message costs O(1) (a node's
aggregated progress report O(its ranks)); an epoch costs O(ranks) once: node
processes holding the previous epoch get one few-byte delta frame (encoded once),
the others their node's view (its ranks, the world size), and each node process
relays it to its own workers (launcher/node/relay.py). Only workers not behind a relay
(no RESILD_RELAY) get the full layout directly from here.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import zmq

from resild.controller.backend import Backend
from resild.controller.broadcast import Broadcaster
from resild.controller.budget import Budget
from resild.controller.effects import Effects
from resild.controller.errors import InternalErrors
from resild.controller.fatal import FATAL_ECHO_S, lone_fatals
from resild.controller.faults import Fault, Injector
from resild.controller.handlers import Handlers
from resild.controller.journal import Journal
from resild.controller.policy import (
    Action,
    PolicyConfig,
    check_grow,
    check_heartbeats,
    check_timeouts,
    controller_stall_s,
    give_up_verdict,
    on_node_failure,
    on_straggler,
    straggler_evidence,
    tick_interval_s,
)
from resild.controller.readmission import readmission
from resild.controller.records import parse_record
from resild.controller.refill import refill
from resild.controller.restore import fold, initial, resume, take_over
from resild.controller.state import ControllerConfig, ControllerState, lease_terms
from resild.controller.status import answer
from resild.controller.stragglers import PRIOR_RECOVERY_S, STRAGGLER_CHECK_S, Paces, window_too_long
from resild.controller.stragglers import find as find_straggler
from resild.controller.view import ClusterView, JobResult, NodeView
from resild.events.log import EventLog
from resild.events.schema import Detector, EventName
from resild.membership import Membership, NodeRole
from resild.wire.channel import Server
from resild.wire.keys import KeyDir
from resild.wire.protocol import Message, MsgType
from resild.wire.settings import JobSettings

_DEFAULT_WINDOW = JobSettings().straggler_window

__all__ = ["Controller", "ControllerConfig", "ControllerFailed", "JobResult"]

log = logging.getLogger("resild.controller")

REFUSED_EVENT_S = 10.0  # at most one peer_refused event per key holder this often


class ControllerFailed(RuntimeError):
    """The controller stopped on its own error, not on a verdict: it told no node to shut
    down (the nodes keep training and follow the next leader, or their lease rules), and
    its caller must not report a verdict either (a standby replica exits: another takes over)."""


class Controller:
    """Construction, the run loop and its tick, dispatch; the handlers (handlers.py) and
    the effects of decisions (effects.py) share one ControllerState (state.py)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        active: list[str],
        spares: list[str],
        nproc_per_node: int,
        keys: KeyDir | None,
        events: EventLog,
        journal: Journal | None = None,
        backend: Backend | None = None,
        faults: list[Fault] | None = None,
        ctx: zmq.Context[Any] | None = None,
        server: Server | None = None,
        leadership: Callable[[], bool] | None = None,
    ) -> None:
        self.nproc = nproc_per_node
        # What the job's size changes (heartbeat budget, lease interval, the nodes' wait),
        # computed once here and told to the node processes (WELCOME, LEASE).
        self.derived = cfg.settings.for_nodes(len(active) + len(spares))
        self.policy = PolicyConfig.from_settings(cfg.settings, self.derived)
        if self.derived.heartbeat_timeout_s > cfg.settings.heartbeat_timeout_s:  # said, never silent
            log.warning(
                "%d nodes on a heartbeat budget of %g/s: nodes heartbeat every %.2fs and are lost after "
                "%.1fs of silence (--heartbeat-timeout %g); leases every %.1fs, nodes wait %.1fs for one",
                len(active) + len(spares),
                cfg.settings.heartbeat_budget_per_s,
                self.derived.heartbeat_interval_s,
                self.derived.heartbeat_timeout_s,
                cfg.settings.heartbeat_timeout_s,
                self.derived.lease_interval_s,
                self.derived.lease_timeout_s,
            )
        self.cfg = cfg
        self.events = events
        self.journal = journal or Journal(None)
        # A fired fault is detected within the hang check's worst case (2 x --hang-timeout)
        # or a lost node's silence: the next step fault waits that long at most.
        settle_s = 2 * cfg.settings.hang_timeout_s + self.derived.heartbeat_timeout_s + 5.0
        self.injector = Injector(faults or [], settle_s)
        self.ctx = ctx or zmq.Context.instance()
        # A server handed in is the caller's (a replica keeps one across leaderships: closing
        # and binding again races libzmq's asynchronous close, 'Address already in use').
        self._owns_server = server is None
        self.server = server or Server(self.ctx, cfg.bind, keys)
        # A standby replica's view of whether it still leads: checked every tick; a deposed
        # leader stops at once and says nothing more to anyone (the new leader speaks).
        self.leadership = leadership
        self.deposed = False
        self.restored = False
        self.endpoint = self.server.endpoint
        self.ch = self.server.channel
        self.ch.on_refused = self._peer_refused
        self._refused: dict[str, tuple[float, int]] = {}  # key holder -> (last event, refusals since)
        nodes = {n: NodeView(n, NodeRole.ACTIVE, nproc_per_node) for n in active}
        nodes.update({n: NodeView(n, NodeRole.SPARE, nproc_per_node) for n in spares})
        self.view = ClusterView(nodes, full_world=len(active) * nproc_per_node, min_replicas=cfg.settings.min_replicas)
        self.bc = Broadcaster(self.ch, self.view, nproc_per_node)
        self.state = ControllerState(
            self.view,
            self.bc,
            events,
            self.journal,
            backend or Backend(),
            Membership.initial(active, nproc_per_node),
            len(active) * nproc_per_node,
            budget=Budget({MsgType.EVENT.value: cfg.event_budget, MsgType.PROGRESS.value: cfg.progress_budget}),
        )
        self.state.keys = keys
        self.state.paces = Paces(cfg.settings.straggler_window)
        self._next_straggler_check_s = 0.0
        self.effects = Effects(self.state, cfg, self.injector)
        self.errors = InternalErrors(events, self.journal)  # our own bugs: reported, never the job's end
        self._tick_failed = False
        self._tick_failing_since: float | None = None  # the tick has failed on every round since
        self.handlers = Handlers(self.state, self.effects, cfg, self.derived)
        self._started = time.monotonic()
        # Leases: one frame per node per interval (at scale rarer still: a lease costs the
        # controller a send per node; JobSettings.for_nodes).
        self._next_lease_s = 0.0
        self._next_refill_s = 0.0

    # The shared state, as callers (resil-run, the standby replica, tests) know it.
    @property
    def backend(self) -> Backend:
        return self.state.backend

    @backend.setter
    def backend(self, backend: Backend) -> None:
        self.state.backend = backend

    @property
    def result(self) -> JobResult | None:
        return self.state.result

    @result.setter
    def result(self, result: JobResult | None) -> None:
        self.state.result = result

    @property
    def max_step(self) -> int:
        return self.state.max_step

    @property
    def node_ident(self) -> dict[str, bytes]:
        return self.state.node_ident

    @property
    def worker_ident(self) -> dict[tuple[str, int], bytes]:
        return self.state.worker_ident

    # ---- main loop -------------------------------------------------------
    def run(self) -> JobResult:
        """Until the job's verdict (finished, failed; cancelled: Ctrl-C). The controller's
        own errors never end the job: a handler's drops its message, a tick step's costs
        that step this round (errors.py). Only when the tick has failed on every round for
        cfg.tick_error_limit_s (policy.give_up_verdict), or the loop itself failed, does
        it stop, raising ControllerFailed, and then it tells no one to shut down: the nodes
        keep training and follow the next leader, or their lease rules."""
        if not self.restored:  # a standby taking over continues the job, it does not start it
            self.events.emit(
                EventName.JOB_STARTED,
                endpoint=self.endpoint,
                nodes=list(self.view.nodes),
                controller_host=socket.gethostname(),
                settings=self.cfg.settings.to_dict(),  # what the job ran with, and what its size made of it
                derived=dataclasses.asdict(self.derived),
            )
        next_tick = 0.0
        try:
            while self.state.result is None:
                wait_s = max(0.001, next_tick - time.monotonic())  # >= 1 ms: never spin
                got = self._recv(wait_s)
                now = time.monotonic()
                if got is not None:
                    ident, msg = got
                    self._dispatch(ident, msg, now)
                    # Bounded, by count and by time: a flood (progress at scale, or a node's
                    # key holder sending large events) must not starve the checks and leases.
                    # Time is what matters: one message may cost a millisecond (1 MB to decode).
                    for _ in range(self.cfg.max_batch):
                        if self.state.result is not None or time.monotonic() >= next_tick:
                            break
                        if (got := self._recv(0)) is None:
                            break
                        self._dispatch(got[0], got[1], time.monotonic())
                    # A message may have started a recovery or a probe: check soon.
                    next_tick = min(next_tick, time.monotonic() + self._tick_interval_s())
                now = time.monotonic()
                # Timeouts are checked once per tick, not after every message: at 10k
                # messages/s the checks would cost more than the messages.
                if self.state.result is None and now >= next_tick:
                    if self.leadership is not None and not self.leadership():
                        log.error("no longer the leader: stopping (the new leader takes over)")
                        self.deposed = True
                        break
                    if stalled_s := controller_stall_s(now, next_tick):
                        log.warning(
                            "the controller did not run for %.1fs: the nodes' clocks move on as much", stalled_s
                        )
                        self.view.shift_clock(stalled_s)
                        self.events.emit(EventName.CONTROLLER_STALLED, seconds=round(stalled_s, 3))
                    self._guarded_tick(now)
                    next_tick = now + self._tick_interval_s()
        except KeyboardInterrupt:
            # The operator's Ctrl-C (resil-run in a terminal): the job is cancelled, a verdict.
            if self.state.result is None:
                self.state.result = JobResult(130, "interrupted")
            raise
        except ControllerFailed:
            raise
        except Exception as e:  # the loop's own machinery (the socket, the leadership check)
            self.errors.record("loop", e, time.monotonic(), fatal=True)
            raise ControllerFailed(f"the controller's loop failed: {e!r}") from e
        finally:
            self.finish()
        if self.state.result is None:  # deposed: no verdict of ours (the new leader's to say)
            assert self.deposed
            return JobResult(1, "deposed: another controller leads")
        return self.state.result

    def _tick_interval_s(self) -> float:
        s = self.state
        busy = (
            s.awaiting_full_strength is not None
            or s.unregistered > 0
            or s.deferred > 0
            or bool(s.deferred_decisions)
            or bool(self.effects.injector.pending)
        )
        return tick_interval_s(self.view, busy, self.cfg.tick_s, self.cfg.idle_tick_s)

    def _recv(self, timeout_s: float) -> tuple[bytes | None, Message] | None:
        """The next message; an error of ours in reading one (not the socket's) drops it."""
        try:
            return self.ch.recv(timeout_s)
        except zmq.ZMQError:
            raise  # the socket itself: the loop's failure
        except Exception as e:
            self.errors.record("recv", e, time.monotonic())
            return None

    def _guarded_tick(self, now: float) -> None:
        """The tick, its errors reported (each step's in `_step`); gives up when it has
        failed on every round for cfg.tick_error_limit_s."""
        self._tick_failed = False
        try:
            self._tick(now)
        except Exception as e:
            self._tick_failed = True
            self.errors.record("tick", e, now)
        if not self._tick_failed:
            self._tick_failing_since = None
            return
        if self._tick_failing_since is None:
            self._tick_failing_since = now
        v = give_up_verdict(now, self._tick_failing_since, self.cfg.tick_error_limit_s)
        if v.guilty:
            failed = ControllerFailed(v.reason)
            self.errors.record("tick", failed, now, fatal=True)
            raise failed

    def _step(self, where: str, step: Callable[[float], None], now: float) -> None:
        """One step of the tick: its error costs this step this round, not the others."""
        if self.state.result is not None:
            return
        try:
            step(now)
        except Exception as e:
            self._tick_failed = True
            self.errors.record(where, e, now)

    def _tick(self, now: float) -> None:
        # The leases first: the nodes' view of whether they have a controller at all.
        self._step("tick:leases", self._leases, now)
        self._step("tick:rendezvous", self._rendezvous_expiry, now)
        self._step("tick:deferred", self.effects.retry_deferred, now)
        self._step("tick:exits", self._exits, now)
        self._step("tick:readmit", self._readmit, now)
        self._step("tick:refill", self._refill, now)
        self._step("tick:grow", self._grow, now)
        started = self.view.membership is not None
        self._step("tick:checks", self._checks, now)
        self._step("tick:stragglers", self._stragglers, now)
        self._step("tick:fatals", self._fatals, now)
        if started:
            self._step("tick:faults", self.effects.fire_faults, now)

    def _leases(self, now: float) -> None:
        if self.derived.lease_interval_s > 0 and now >= self._next_lease_s:
            self.bc.send_leases(*lease_terms(self.cfg, self.derived))
            self._next_lease_s = now + self.derived.lease_interval_s

    def _rendezvous_expiry(self, now: float) -> None:
        for to, reply in self.state.rendezvous.expire(now):
            self.ch.send(MsgType.STORE_REPLY, reply, to=to)

    def _exits(self, now: float) -> None:
        for node, rc in self.backend.exited_nodes():
            self.effects.decide(
                on_node_failure(self.view, node, f"node process exited with code {rc}", Detector.PROCESS_EXIT.value),
                now,
            )

    def _refill(self, now: float) -> None:
        if self.cfg.spare_target <= 0 or now < self._next_refill_s:
            return
        self._next_refill_s = now + self.cfg.refill_interval_s
        on_the_way = self.backend.spares_on_the_way(frozenset(self.state.joined_sources))
        r = refill(self.view, self.cfg.spare_target, on_the_way)
        if r.count > 0:
            log.warning("asking the queue for %d cold spare(s): %s", r.count, r.reason)
            self.backend.request_spares(r.count)
            self.events.emit(EventName.SPARES_REQUESTED, count=r.count, reason=r.reason)

    def _grow(self, now: float) -> None:
        if self.view.min_replicas > 0 and self.state.result is None:
            self.effects.decide(check_grow(self.view, busy=self.state.awaiting_full_strength is not None), now)

    def _fatals(self, now: float) -> None:
        if self.state.fatals:
            self.effects.decide(lone_fatals(now, self.view, self.state.fatals, FATAL_ECHO_S), now)

    def _stragglers(self, now: float) -> None:
        """A node persistently slower than the others: said once an epoch, and replaced when
        that pays (policy.on_straggler); never during a recovery or after the verdict."""
        st, settings = self.state, self.cfg.settings
        if settings.stragglers == "off" or st.result is not None or st.awaiting_full_strength is not None:
            return
        if self.view.membership is None or now < self._next_straggler_check_s:
            return
        self._next_straggler_check_s = now + STRAGGLER_CHECK_S  # O(nodes x window): not every tick
        if not st.window_judged and st.steps_planned > 0:
            st.window_judged = True
            # said for a window the user chose: the default's on a short smoke test is nobody's mistake
            chosen = settings.straggler_window != _DEFAULT_WINDOW
            if chosen and (why := window_too_long(settings.straggler_window, st.steps_planned)) is not None:
                self.events.emit(EventName.STRAGGLERS_UNWATCHED, window=settings.straggler_window, reason=why)
        found = find_straggler(st.paces.view(), settings.straggler_window, settings.straggler_threshold)
        if found is None:
            return
        steps_left = max(0, st.steps_planned - st.max_step)
        recovery_s = statistics.median(st.recoveries_s) if st.recoveries_s else PRIOR_RECOVERY_S
        d, cost_s = on_straggler(self.view, found, settings.stragglers == "replace", steps_left, recovery_s)
        key = (st.paces.epoch, found.node)
        if key in st.stragglers_said and d.action == Action.NONE:
            return  # said already; looked at again as its window fills (it may come to pay)
        st.stragglers_said.add(key)
        self.events.emit(
            EventName.STRAGGLER,
            node=found.node,
            slowdown=round(found.slowdown, 4),
            pace_s=round(found.pace_s, 6),
            others_s=round(found.others_s, 6),
            window=found.steps,
            steps_left=steps_left,
            cost_s=round(cost_s, 3),
            recovery_s=round(recovery_s, 3),
            replaced=d.action == Action.REPLACE_NODE,
            evidence=straggler_evidence(self.view, found.node),
            reason=d.reason,
        )
        if d.action == Action.REPLACE_NODE:
            st.paces.forget(found.node)
            self.effects.decide(d, now)
        elif straggler_evidence(self.view, found.node) and settings.stragglers == "replace":
            # kept in this job (no spare, or it does not pay), but out of the scheduler's
            # pool for the next: a drain lets the running job finish on it
            self.effects.drain(found.node, d.reason)

    def _readmit(self, now: float) -> None:
        if not self.cfg.readmit:
            return
        r = readmission(now, self.view, self.backend.restartable(), self.policy.readmit_quiet_s)
        if r is not None:
            self.effects.readmit(r, now)

    def _checks(self, now: float) -> None:
        if self.view.membership is None:
            # Start-up: a node lost now is replaced by a spare in the first epoch.
            self.effects.decide(check_heartbeats(now, self.view, self.policy), now)
            if self.state.unregistered <= 0:
                self.effects.start(now)  # its journal record was not committed before: again
            if self.state.result is None and now - self._started > self.cfg.settings.start_timeout_s:
                missing = [
                    n for n, v in self.view.nodes.items() if v.role == NodeRole.ACTIVE and v.workers_ready < v.nproc
                ]
                self.state.result = JobResult(
                    1,
                    f"start timed out after {self.cfg.settings.start_timeout_s:.0f}s waiting for {', '.join(missing)}",
                )
            return
        d = check_timeouts(now, self.view, self.policy)
        if self.view.probe_sent_s is not None and now - self.view.probe_sent_s >= self.policy.probe_timeout_s:
            self.view.probe_sent_s = None  # probe answered (or judged): done
        self.effects.decide(d, now)

    # ---- messages --------------------------------------------------------
    def _dispatch(self, ident: bytes | None, msg: Message, now: float) -> None:
        """The loop outlives any one message: a handler's exception (ours) drops the message;
        it is reported (errors.py) and its sender answered."""
        try:
            self._handle(ident, msg, now)
        except Exception as e:
            self.errors.record(f"handler:{msg.type.value}", e, now, sender=msg.sender[:128])
            if ident is not None:
                self.ch.send(MsgType.ERROR, {"code": "internal", "detail": f"{msg.type.value}: {e!r}"[:1024]}, to=ident)

    def _peer_refused(self, user: str, ident: bytes | None, why: str) -> None:
        """A key holder spoke as someone else (channel.py refused it): named in an event,
        its first refusal and then one per REFUSED_EVENT_S with the count (a flood of forged
        frames must not become a flood of events)."""
        try:
            self._name_refused(user, ident, why)
        except Exception as e:  # called from recv: a forged frame must never stop the loop
            self.errors.record("refused", e, time.monotonic(), key=user)

    def _name_refused(self, user: str, ident: bytes | None, why: str) -> None:
        now = time.monotonic()
        last_s, count = self._refused.get(user, (-1e9, 0))
        count += 1
        if now - last_s < REFUSED_EVENT_S:
            self._refused[user] = (last_s, count)
            return
        self._refused[user] = (now, 0)
        log.error("refused a message from the key of %r: %s (%d refused)", user, why, count)
        self.events.emit(
            EventName.PEER_REFUSED,
            key=user,
            routing_id=(ident or b"")[:64].decode(errors="replace"),
            reason=why[:300],
            refused=count,
        )

    def _handle(self, ident: bytes | None, msg: Message, now: float) -> None:
        self.handlers.handle(ident, msg, now)

    def restore(self, records: list[dict[str, Any]], now: float) -> None:
        """Take over from a journal (a standby's replicated copy, or a restarted
        controller's file): roles, fenced nodes, epoch and the faults already fired.
        Everything else comes back from the nodes, which re-register with a new leader
        (they follow the highest lease term) and heartbeat within their interval: a
        node that does not is lost like any silent node."""
        self.restored = True
        folded = fold(map(parse_record, records), initial(self.state))
        take_over(self.state, folded, now)
        gone = folded.fired - folded.unsettled  # fired and handled: never again
        self.injector.pending = [f for f in self.injector.pending if str(f) not in gone]
        self._next_lease_s = 0.0
        m = self.view.membership
        self.events.emit(
            EventName.CONTROLLER_RESTORED,
            records=len(records),
            epoch=m.epoch if m else 0,
            fenced=sorted(n.node_id for n in self.view.nodes.values() if n.role == NodeRole.FENCED),
            spares=[n.node_id for n in self.view.spares()],
            committed_step=self.state.max_step,
        )

    def resume(self, records: list[dict[str, Any]]) -> None:
        """Start a new run of the job from its journal (restore.resume): the job starts
        again (a `job_started`), with the nodes it had and without the ones it fenced."""
        folded = fold(map(parse_record, records), initial(self.state))
        resume(self.state, folded)
        self.injector.pending = [f for f in self.injector.pending if str(f) not in folded.fired]
        self.events.emit(
            EventName.CONTROLLER_RESTORED,
            records=len(records),
            epoch=0,
            fenced=sorted(n.node_id for n in self.view.nodes.values() if n.role == NodeRole.FENCED),
            spares=[n.node_id for n in self.view.spares()],
            committed_step=0,
        )

    def finish(self) -> None:
        """SHUTDOWN goes out only with a verdict (effects.finish): not from a deposed
        leader (the new one speaks), nor from a controller that failed on its own."""
        try:
            if self.deposed:
                pass
            elif self.state.result is not None:
                self.effects.finish()
            else:
                log.error("stopping without a verdict: the nodes are not told to shut down (they keep training)")
        finally:
            if self._owns_server:
                self.server.close()
            else:
                self.ch.on_refused = None  # the caller's server outlives this controller
            self.journal.close()

    def status(self) -> dict[str, Any]:
        return answer(self.state, self.cfg.spare_target)
