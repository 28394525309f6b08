"""The controller: the only place where decisions are made.

Single-threaded loop over a ROUTER socket. Every message handler updates the
ClusterView; decisions come from `policy` (pure) and are journaled before the
I/O that carries them out.

Cost model (it has to hold at 16k ranks): every message costs O(1) (a node's
aggregated progress report O(its ranks)); an epoch costs O(ranks) once: node
processes holding the previous epoch get one few-byte delta frame (encoded once),
the others their node's view (its ranks, the world size), and each node process
relays it to its own workers (launcher/node/relay.py). Only workers not behind a relay
(no RESILD_RELAY) get the full layout directly from here.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

import zmq

from resild.controller.backend import Backend
from resild.controller.broadcast import Broadcaster
from resild.controller.faults import Fault, Injector
from resild.controller.journal import Journal
from resild.controller.policy import (
    Action,
    Decision,
    PolicyConfig,
    check_done,
    check_heartbeats,
    check_timeouts,
    on_node_failure,
    on_worker_exception,
)
from resild.controller.records import FaultFired, Start, decided, parse_record
from resild.controller.restore import Restored, fold
from resild.controller.status import status
from resild.controller.view import ClusterView, JobResult, NodeView, RankProgress
from resild.events.log import EventLog
from resild.events.schema import EventName
from resild.membership import Membership, NodeRole
from resild.wire.channel import Server
from resild.wire.keys import KeyDir
from resild.wire.protocol import (
    BODY_TYPES,
    Done,
    Event,
    Failed,
    Fatal,
    Health,
    Heartbeat,
    Message,
    MsgType,
    Progress,
    ProtocolError,
    RegisterNode,
    RegisterWorker,
    WorkerExit,
)
from resild.wire.settings import JobSettings

log = logging.getLogger("resild.controller")


def median_step_s(commit_times: list[tuple[int, float, str | None]]) -> float | None:
    """The median step time from (step, t, node) points, one per advance of the job's step.
    Only one node's consecutive steps count: step s from one node's report and s+1 from
    another's a few ms later is reporting skew, not a step (seen: 4.5 ms for 16 ms steps)."""
    times = [t2 - t1 for (s1, t1, n1), (s2, t2, n2) in zip(commit_times, commit_times[1:]) if s2 == s1 + 1 and n1 == n2]
    return median(times) if times else None


@dataclass
class ControllerConfig:
    bind: str = "tcp://127.0.0.1:0"
    # The job's timeouts (one owner: resil-run builds it once; see resild.wire.settings).
    # The policy's view of them, and what the job's size changes, are derived in Controller.
    settings: JobSettings = field(default_factory=JobSettings)
    tick_s: float = 0.02
    max_batch: int = 1000  # messages handled before the timeout checks run again
    resync_s: float = 1.0  # a node still reporting an old epoch this long after a send gets its view again
    shutdown_timeout_s: float = 600.0  # at success: time for workers to finish (final save)
    wait_nodes_gone_s: float = 0.0  # > 0: at the end, wait until no node process has heartbeat for this long
    store_addr: str = ""
    term: int = 1  # rises with every leader (standby controllers); nodes follow the highest
    leader_index: int = 0  # this controller's place in the endpoint list node processes hold


class Controller:
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
        self.cfg = cfg
        self.events = events
        self.journal = journal or Journal(None)
        self.backend = backend or Backend()
        self.injector = Injector(faults or [])
        self.ctx = ctx or zmq.Context.instance()
        self.server = server or Server(self.ctx, cfg.bind, keys)
        # A standby replica's view of whether it still leads: checked every tick; a deposed
        # leader stops at once and says nothing more to anyone (the new leader speaks).
        self.leadership = leadership
        self.deposed = False
        self.restored = False
        self.endpoint = self.server.endpoint
        self.ch = self.server.channel
        nodes = {n: NodeView(n, NodeRole.ACTIVE, nproc_per_node) for n in active}
        nodes.update({n: NodeView(n, NodeRole.SPARE, nproc_per_node) for n in spares})
        self.view = ClusterView(nodes)
        self._initial = Membership.initial(active, nproc_per_node)
        self.bc = Broadcaster(self.ch, self.view, nproc_per_node)
        self.node_ident = self.bc.node_ident
        self.worker_ident = self.bc.worker_ident
        self._unregistered = len(active) * nproc_per_node  # active workers yet to register: O(1) start check
        # Each handler takes its message type's body class (protocol.BODY_TYPES), as decode built it.
        self._handlers: dict[MsgType, Callable[[bytes, NodeView, Any, float], None]] = {
            MsgType.REGISTER_NODE: self._on_register_node,
            MsgType.HEARTBEAT: self._on_heartbeat,
            MsgType.WORKER_EXIT: self._on_worker_exit,
            MsgType.HEALTH: self._on_health,
            MsgType.REGISTER_WORKER: self._on_register_worker,
            MsgType.PROGRESS: self._on_progress,
            MsgType.EVENT: self._on_event,
            MsgType.DONE: self._on_done,
            MsgType.FAILED: self._on_failed,
            MsgType.FATAL: self._on_fatal,
        }
        self.max_step = 0
        self.result: JobResult | None = None
        self._started = time.monotonic()
        self._awaiting_full_strength: int | None = None  # epoch whose first commit we wait for
        # (step, t, node) each time the job's step advanced
        self._commit_times: list[tuple[int, float, str | None]] = []
        # Leases: one frame per node per interval (at scale rarer still: a lease costs the
        # controller a send per node; JobSettings.for_nodes).
        self._next_lease_s = 0.0

    # ---- main loop -------------------------------------------------------
    def run(self) -> JobResult:
        if not self.restored:  # a standby taking over continues the job, it does not start it
            self.events.emit(
                EventName.JOB_STARTED,
                endpoint=self.endpoint,
                nodes=list(self.view.nodes),
                controller_host=socket.gethostname(),
            )
        next_tick = 0.0
        try:
            while self.result is None:
                wait_s = max(0.001, min(self.cfg.tick_s, next_tick - time.monotonic()))  # >= 1 ms: never spin
                got = self.ch.recv(wait_s)
                now = time.monotonic()
                if got is not None:
                    ident, msg = got
                    self._dispatch(ident, msg, now)
                    # Bounded: at scale a flood of progress reports must not starve the checks.
                    for _ in range(self.cfg.max_batch):
                        if self.result is not None or (got := self.ch.recv(0)) is None:
                            break
                        self._dispatch(got[0], got[1], time.monotonic())
                now = time.monotonic()
                # Timeouts are checked once per tick, not after every message: at 10k
                # messages/s the checks would cost more than the messages.
                if self.result is None and now >= next_tick:
                    if self.leadership is not None and not self.leadership():
                        log.error("no longer the leader: stopping (the new leader takes over)")
                        self.deposed = True
                        break
                    self._tick(now)
                    next_tick = now + self.cfg.tick_s
        finally:
            self._finish()
        assert self.result is not None  # _finish always leaves a verdict
        return self.result

    def _tick(self, now: float) -> None:
        if self.derived.lease_interval_s > 0 and now >= self._next_lease_s:
            self.bc.send_leases(*self._lease())
            self._next_lease_s = now + self.derived.lease_interval_s
        for node, rc in self.backend.exited_nodes():
            self._decide(on_node_failure(self.view, node, f"node process exited with code {rc}", "process-exit"), now)
        if self.view.membership is None:
            # Start-up: a node lost now is replaced by a spare in the first epoch.
            self._decide(check_heartbeats(now, self.view, self.policy), now)
            if self.result is None and now - self._started > self.cfg.settings.start_timeout_s:
                missing = [
                    n for n, v in self.view.nodes.items() if v.role == NodeRole.ACTIVE and v.workers_ready < v.nproc
                ]
                self.result = JobResult(
                    1,
                    f"start timed out after {self.cfg.settings.start_timeout_s:.0f}s waiting for {', '.join(missing)}",
                )
            return
        d = check_timeouts(now, self.view, self.policy)
        if self.view.probe_sent_s is not None and now - self.view.probe_sent_s >= self.policy.probe_timeout_s:
            self.view.probe_sent_s = None  # probe answered (or judged): done
        self._decide(d, now)
        self._fire_faults(now)

    # ---- message handlers --------------------------------------------------
    def _dispatch(self, ident: bytes | None, msg: Message, now: float) -> None:
        """The loop outlives any one message: a handler's exception is logged and answered."""
        try:
            self._handle(ident, msg, now)
        except Exception as e:
            log.exception("handling %s from %s failed", msg.type.value, msg.sender)
            if ident is not None:
                self.ch.send(MsgType.ERROR, {"code": "internal", "detail": f"{msg.type.value}: {e!r}"[:1024]}, to=ident)

    def _handle(self, ident: bytes | None, msg: Message, now: float) -> None:
        assert ident is not None
        typed = msg.typed
        node_id = typed.node or "" if typed is not None else str(msg.body.get("node", ""))
        node = self.view.nodes.get(node_id)
        if msg.type in (MsgType.STATUS,):
            self.ch.send(MsgType.STATUS_REPLY, self.status(), to=ident)
            return
        if node is None:
            self.ch.send(
                MsgType.ERROR, {"code": "unknown_node", "detail": f"{node_id!r} is not part of this job"}, to=ident
            )
            return
        if node.role == NodeRole.FENCED:
            # A fenced node never rejoins: whatever it says, it is told to die.
            self.ch.send(MsgType.FENCE, {"reason": node.reason}, to=ident)
            return
        handler = self._handlers.get(msg.type)
        if handler is None:
            self.ch.send(
                MsgType.ERROR, {"code": "unexpected", "detail": f"{msg.type.value} not accepted here"}, to=ident
            )
            return
        try:
            # decode made the typed body; a Message made some other way is validated here
            body = typed if typed is not None else BODY_TYPES[msg.type].from_dict(msg.body)
            handler(ident, node, body, now)
        except (KeyError, ValueError, TypeError, ProtocolError) as e:
            # A well-framed message with a bad body: answer and log, never crash the job.
            log.warning("bad %s body from %s: %r", msg.type.value, msg.sender, e)
            self.ch.send(MsgType.ERROR, {"code": "bad_body", "detail": f"{msg.type.value}: {e!r}"}, to=ident)

    def _on_register_node(self, ident: bytes, node: NodeView, b: RegisterNode, now: float) -> None:
        self.node_ident[node.node_id] = ident
        node.registered, node.host_pid = True, b.pid
        self.view.beat(node.node_id, now)
        self._node_state(node, b)
        self.events.emit(EventName.NODE_REGISTERED, node=node.node_id, role=node.role.value, pid=b.pid)
        if self.derived.heartbeat_interval_s > self.cfg.settings.heartbeat_interval_s:  # the budget at this size
            self.ch.send(MsgType.WELCOME, {"heartbeat_s": self.derived.heartbeat_interval_s}, to=ident)
        if self.derived.lease_interval_s > 0:
            self.bc.send_raw(ident, self.bc.lease_frame(*self._lease()))
        m = self.view.membership
        if m is not None and node.node_id in m.node_ranks:  # a (re)started node process
            self.bc.send_view(node, ident, now)

    def _on_heartbeat(self, ident: bytes, node: NodeView, b: Heartbeat, now: float) -> None:
        # The node daemon may heartbeat too, but the job's liveness is its node process:
        # only that one refreshes the clock and receives FENCE/INJECT/SHUTDOWN.
        if not ident.endswith(b"/node"):
            return
        self.node_ident[node.node_id] = ident
        self.view.beat(node.node_id, now)
        node.registered = True
        if node.host_pid is None and b.pid is not None:
            node.host_pid = b.pid  # a standby that took over never saw the registration
        if b.health is not None:
            node.health = b.health
        self._node_state(node, b)
        m = self.view.membership
        if (
            m is not None
            and node.epoch_have < m.epoch
            and b.epoch is not None
            and node.node_id in m.node_ranks
            and (b.resync or now - node.membership_sent_s > self.cfg.resync_s)
        ):
            # It missed an epoch (a lost send, a delta it could not apply): its view again.
            self.bc.send_view(node, ident, now)

    @staticmethod
    def _node_state(node: NodeView, b: RegisterNode | Heartbeat) -> None:
        """What a node process says about its relay: the epoch it holds, the local ranks
        it relays to (those need no direct sends)."""
        if b.epoch is not None:
            node.epoch_have = b.epoch
        if b.relayed is not None:
            node.relayed = frozenset(b.relayed)

    def _on_worker_exit(self, ident: bytes, node: NodeView, b: WorkerExit, now: float) -> None:
        rc = b.returncode
        if rc == 0 and node.role == NodeRole.ACTIVE and self._node_done(node):
            return
        how = f"signal {-rc}" if rc is not None and rc < 0 else f"code {rc}"
        cause = f"worker {b.local_rank} (pid {b.pid}) exited with {how}"
        self._decide(on_node_failure(self.view, node.node_id, cause, "process-exit", worker_fault=True), now)

    def _on_health(self, ident: bytes, node: NodeView, b: Health, now: float) -> None:
        node.health = b.verdict or "unknown"
        if node.health == "failed":
            reasons = b.reasons or ["GPU failed"]
            self._decide(
                on_node_failure(
                    self.view, node.node_id, "; ".join(reasons), b.detector if b.detector is not None else "gpu-probe"
                ),
                now,
            )

    def _on_register_worker(self, ident: bytes, node: NodeView, b: RegisterWorker, now: float) -> None:
        lr = b.local_rank if b.local_rank is not None else -1
        if not 0 <= lr < node.nproc:
            self.ch.send(MsgType.ERROR, {"code": "bad_local_rank", "detail": f"local rank {lr} out of range"}, to=ident)
            return
        if (node.node_id, lr) not in self.worker_ident:
            node.workers_ready += 1
            if node.role == NodeRole.ACTIVE:
                self._unregistered -= 1
        self.events.emit(EventName.WORKER_REGISTERED, node=node.node_id, local_rank=lr, pid=b.pid)
        self.worker_ident[(node.node_id, lr)] = ident
        if not self.bc.welcome_json:  # the same for every worker: encoded once per job
            self.bc.welcome_json = json.dumps(
                {"store": self.cfg.store_addr, **self.cfg.settings.worker_timeouts()}, separators=(",", ":")
            ).encode()
        self.bc.send_raw(ident, self.bc.frame(MsgType.WELCOME, self.bc.welcome_json, ttl_s=10.0))
        m = self.view.membership
        if m is not None and node.node_id in m.node_ranks:
            if lr not in node.relayed:  # a relayed worker gets it from its node on its hello
                self.bc.send_layout(ident)
        elif m is None and self._unregistered <= 0:
            self._start(now)

    def _on_progress(self, ident: bytes, node: NodeView, b: Progress, now: float) -> None:
        if b.commits is not None:
            self._on_commits(node, b.commits, b.epoch, now)
            return
        rank, epoch, step = b.rank, b.epoch, b.step
        if rank is None or epoch is None or step is None:
            raise KeyError("rank, epoch and step are required")
        m = self.view.membership
        if m is None or m.node_ranks.get(node.node_id) is None or rank not in m.node_ranks[node.node_id]:
            return  # stale sender
        if b.state == "collective_failed" and self.view.probe_sent_s is None and epoch == m.epoch:
            self.events.emit(EventName.COLLECTIVE_FAILED, rank=rank, epoch=epoch, error=(b.error or "")[:300])
            self.view.probe_sent_s, self.view.probe_epoch = now, epoch
            targets = [n for n, v in self.view.nodes.items() if v.role == NodeRole.ACTIVE and n in self.node_ident]
            self.view.probe_targets = frozenset(targets)
            for node_id in targets:
                self.ch.send(MsgType.PING, {}, to=self.node_ident[node_id], ttl_s=1.0)
        if b.state == "joined" and epoch == m.epoch:
            # A rank finished this epoch's recovery (the spare is last: it built its model
            # first). The stall clock starts now, not at the announcement.
            self.view.epoch_started_s = max(self.view.epoch_started_s, now)
        self._rank_progress(rank, epoch, step, b.state if b.state is not None else "compute", m, now)

    def _on_commits(self, node: NodeView, commits: dict[int, int], epoch: int | None, now: float) -> None:
        """A node process's aggregate of its ranks' commits: {"commits": {rank: step}, "epoch"}."""
        if epoch is None:
            raise KeyError("epoch is required with commits")
        m = self.view.membership
        mine = m.node_ranks.get(node.node_id) if m is not None else None
        if m is None or mine is None:
            return  # stale sender
        for rank, step in commits.items():
            if rank in mine:
                self._rank_progress(rank, epoch, step, "commit", m, now)

    def _rank_progress(self, rank: int, epoch: int, step: int, state: str, m: Membership, now: float) -> None:
        p = self.view.progress.get(rank)
        if p is None:
            p = self.view.progress[rank] = RankProgress()
        committed = step > p.step or epoch != p.epoch
        p.step, p.epoch, p.state, p.t_s = step, epoch, state, now
        if state == "commit" and epoch == m.epoch:
            self.view.last_commit_s = now
            if step > self.max_step:
                self.max_step = step
                self._commit_times.append((step, now, m.node_of(rank)))
                self.events.progress(step, epoch)  # throttled: step-vs-time line, live status
            if self._awaiting_full_strength == epoch and committed:
                self._awaiting_full_strength = None
                self.events.emit(EventName.FULL_STRENGTH_STEP, epoch=epoch, step=step, rank=rank)

    def _on_event(self, ident: bytes, node: NodeView, b: Event, now: float) -> None:
        self.events.emit(b.name or "worker_event", node=node.node_id, **(b.fields or {}))

    def _on_failed(self, ident: bytes, node: NodeView, b: Failed, now: float) -> None:
        error = b.error if b.error is not None else "an exception"
        cause = f"worker {b.local_rank} (pid {b.pid}) raised {error}"
        self._decide(on_worker_exception(self.view, node.node_id, error, cause), now)
        self.view.exceptions_seen.append(error)

    def _on_fatal(self, ident: bytes, node: NodeView, b: Fatal, now: float) -> None:
        error = b.error if b.error is not None else "no reason given"
        self._decide(Decision(Action.FAIL_JOB, f"unrecoverable: {error}", detector="runtime"), now)

    def _on_done(self, ident: bytes, node: NodeView, b: Done, now: float) -> None:
        m = self.view.membership
        if m is None or b.epoch != m.epoch or b.rank is None:
            return  # sent before a re-form: the rank reports again in the new epoch
        self.view.done_ranks.add(b.rank)
        if self.view.first_done_s is None:
            self.view.first_done_s = now
        self.events.emit(EventName.RANK_DONE, node=node.node_id, rank=b.rank, pid=b.pid, step=b.step)
        self._decide(check_done(self.view), now)

    def _node_done(self, node: NodeView) -> bool:
        m = self.view.membership
        return m is not None and all(r in self.view.done_ranks for r in m.node_ranks.get(node.node_id, ()))

    # ---- acting on decisions ---------------------------------------------
    def _decide(self, d: Decision, now: float) -> None:
        if d.action == Action.NONE:
            return
        self.journal.append(decided(d, self.max_step, time.time()))
        if d.action in (Action.REPLACE_NODE, Action.DROP_SPARE, Action.FAIL_JOB) and d.node:
            self.events.emit(
                EventName.FAILURE_DETECTED,
                node=d.node,
                cause=d.reason,
                detector=d.detector,
                committed_step=self.max_step,
            )
            self._fence(d.node, d.reason)
        if d.action == Action.REPLACE_NODE and d.membership is None:
            # Before the first epoch: the spare takes the failed node's place in it.
            assert d.node and d.spare
            self.view.nodes[d.spare].set_role(NodeRole.ACTIVE)
            self._initial = self._initial.replace(d.node, d.spare, next_epoch=False)
            self._unregistered = sum(
                max(0, self.view.nodes[n].nproc - self.view.nodes[n].workers_ready) for n in self._initial.node_ranks
            )
            self.events.emit(
                EventName.SPARE_ASSIGNED,
                spare=d.spare,
                failed=d.node,
                epoch=self._initial.epoch,
                ranks=list(self._initial.node_ranks[d.spare]),
                spares_left=len(self.view.spares()),
                before_start=True,
            )
            if self._unregistered <= 0:
                self._start(now)
        elif d.action == Action.REPLACE_NODE:
            assert d.spare and d.membership
            self.view.nodes[d.spare].set_role(NodeRole.ACTIVE)
            self.events.emit(
                EventName.SPARE_ASSIGNED,
                spare=d.spare,
                failed=d.node,
                epoch=d.membership.epoch,
                ranks=list(d.membership.node_ranks[d.spare]),
                spares_left=len(self.view.spares()),
            )
            self._apply_membership(d.membership, now)
        elif d.action == Action.REFORM:
            assert d.membership is not None
            self.events.emit(EventName.REFORM, epoch=d.membership.epoch, reason=d.reason)
            self._apply_membership(d.membership, now)
        elif d.action == Action.FAIL_JOB:
            self.events.emit(EventName.JOB_FAILED, reason=d.reason)
            self.result = JobResult(1, d.reason)
        elif d.action == Action.FINISH:
            ct = self._commit_times
            train_s = ct[-1][1] - ct[0][1] if len(ct) > 1 else 0.0
            self.events.emit(
                EventName.JOB_FINISHED,
                reason=d.reason,
                step=ct[-1][0] - ct[0][0] if ct else 0,
                final_step=self.max_step,
                train_s=train_s,
                step_s=median_step_s(ct),
            )
            self.result = JobResult(0, d.reason)

    def _fence(self, node_id: str, reason: str) -> None:
        node = self.view.nodes[node_id]
        node.set_role(NodeRole.FENCED, reason)
        if node_id in self.node_ident:
            self.ch.send(MsgType.FENCE, {"reason": reason}, to=self.node_ident[node_id])
        self.backend.fence(node_id, reason)
        self.backend.drain(node_id, reason)
        self.events.emit(EventName.NODE_FENCED, node=node_id, reason=reason)

    def _start(self, now: float) -> None:
        """Every active worker registered: the first epoch, journaled like any decision."""
        self.journal.append(Start(self._initial, "every active worker registered", time.time()))
        self._apply_membership(self._initial, now)

    def restore(self, records: list[dict[str, Any]], now: float) -> None:
        """Take over from a journal (a standby's replicated copy, or a restarted
        controller's file): roles, fenced nodes, epoch and the faults already fired.
        Everything else comes back from the nodes, which re-register with a new leader
        (they follow the highest lease term) and heartbeat within their interval: a
        node that does not is lost like any silent node."""
        self.restored = True
        nodes = self.view.nodes
        initial = Restored(
            {n: v.role for n, v in nodes.items()},
            {n: v.reason for n, v in nodes.items()},
            self._initial,
            self.view.membership,
            self.max_step,
            self.result,
        )
        state = fold(map(parse_record, records), initial)
        for node_id, role in state.roles.items():
            if nodes[node_id].role != role:
                nodes[node_id].set_role(role)
            nodes[node_id].reason = state.reasons[node_id]
        self._initial, self.view.membership = state.initial, state.membership
        self.max_step, self.result = state.max_step, state.result
        self.injector.pending = [f for f in self.injector.pending if str(f) not in state.fired]
        m = self.view.membership
        for n in self.view.nodes.values():
            if n.role in (NodeRole.ACTIVE, NodeRole.SPARE):
                n.registered = True  # known from before: silent from now on means lost
                self.view.beat(n.node_id, now)
                # Node processes connect to every replica under this identity: the first
                # lease reaches them before they speak to us.
                self.node_ident[n.node_id] = f"{n.node_id}/node".encode()
        self._next_lease_s = 0.0
        self._unregistered = sum(self.view.nodes[n].nproc for n in self._initial.node_ranks)
        if m is not None:
            self.bc.set_layout(m)
            # The hang clock starts at the takeover: ranks blocked then report again.
            self.view.epoch_started_s = self.view.last_commit_s = now
            self._awaiting_full_strength = m.epoch
        self.events.emit(
            EventName.CONTROLLER_RESTORED,
            records=len(records),
            epoch=m.epoch if m else 0,
            fenced=sorted(n.node_id for n in self.view.nodes.values() if n.role == NodeRole.FENCED),
            spares=[n.node_id for n in self.view.spares()],
            committed_step=self.max_step,
        )

    def _apply_membership(self, m: Membership, now: float) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        prev = self.view.membership
        self.view.membership = m
        self.view.done_ranks.clear()  # ranks re-report done in the new epoch
        self.view.first_done_s = None
        self.view.epoch_started_s = now
        self._awaiting_full_strength = m.epoch
        sent = self.bc.announce(m, prev, now)
        self.events.emit(
            EventName.MEMBERSHIP,
            epoch=m.epoch,
            layout=sent.layout["node_ranks"],
            view=sent.view,
            delta=sent.delta,
            direct=sent.direct,
            announce_s=round(time.perf_counter() - t0, 6),
            announce_cpu_s=round(time.thread_time() - cpu0, 6),
        )
        self._fire_faults(now)  # faults armed on this epoch hit during the recovery itself

    def _lease(self) -> tuple[int, int, float, float, str]:
        """What a lease says: term, leader index, interval, the nodes' wait, store."""
        d = self.derived
        return self.cfg.term, self.cfg.leader_index, d.lease_interval_s, d.lease_timeout_s, self.cfg.store_addr

    def _fire_faults(self, now: float) -> None:
        epoch = self.view.membership.epoch if self.view.membership else 0
        for f in self.injector.due(self.max_step, now, epoch):
            self.journal.append(FaultFired(str(f), time.time()))  # fired once, ever
            self.events.emit(EventName.FAULT_INJECTED, kind=f.kind, node=f.node, step=self.max_step, spec=str(f))
            if f.kind == "exception":
                ident = self.worker_ident.get((f.node, f.local_rank))
            else:
                ident = self.node_ident.get(f.node)
            if ident is None:
                log.warning("cannot inject %s: %s is not connected", f, f.node)
                continue
            self.ch.send(MsgType.INJECT, {"kind": f.kind, "local_rank": f.local_rank, "xid": f.xid}, to=ident)

    def _finish(self) -> None:
        if self.deposed:
            self.server.close()
            self.journal.close()
            return
        if self.result is None:  # interrupted (Ctrl-C) or crashed: stop everything
            self.result = JobResult(130, "interrupted")
        for node_id, ident in self.node_ident.items():
            if self.view.nodes[node_id].role != NodeRole.FENCED:
                self.ch.send(
                    MsgType.SHUTDOWN, {"reason": self.result.reason, "exit_code": self.result.exit_code}, to=ident
                )
        for (node_id, lr), ident in self.worker_ident.items():
            node = self.view.nodes[node_id]
            if node.role != NodeRole.FENCED and lr not in node.relayed:  # relayed ones hear it from their node
                self.ch.send(
                    MsgType.SHUTDOWN, {"reason": self.result.reason, "exit_code": self.result.exit_code}, to=ident
                )
        if self.cfg.wait_nodes_gone_s > 0:
            self._wait_nodes_gone(self.cfg.shutdown_timeout_s if self.result.exit_code == 0 else 10.0)
        self.backend.shutdown(self.cfg.shutdown_timeout_s if self.result.exit_code == 0 else 0.0)
        self.server.close()
        self.journal.close()

    def _wait_nodes_gone(self, timeout_s: float) -> None:
        """Without a backend that sees node processes (a standby leader under Slurm), the
        job is over once they stop heartbeating: their workers may still be saving."""
        t0 = last = time.monotonic()
        while (now := time.monotonic()) - t0 < timeout_s and now - last < self.cfg.wait_nodes_gone_s:
            got = self.ch.recv(0.1)
            if got is not None and got[1].type == MsgType.HEARTBEAT and got[1].sender.endswith("/node"):
                last = time.monotonic()

    def status(self) -> dict[str, Any]:
        return status(self.view, self.max_step, getattr(self.backend, "drained", {}), time.monotonic())
