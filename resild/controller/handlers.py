"""The controller's message handlers: what each message from a node process or a
worker changes in the view of the job.

`handle` routes one message to its handler (STATUS, unknown and fenced senders
answered first); each handler takes its message type's typed body (protocol.BODY_TYPES)
and updates the shared ControllerState. Decisions come from `policy` (pure) and are
carried out by Effects; nothing here does I/O of its own but answers and views.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from resild.controller.admission import admission
from resild.controller.effects import Effects
from resild.controller.fatal import on_fatal
from resild.controller.plausible import corroborated
from resild.controller.policy import (
    abuse_verdict,
    check_done,
    on_collective_abort,
    on_node_failure,
    on_worker_exception,
)
from resild.controller.records import ReplicaUnit
from resild.controller.state import ControllerConfig, ControllerState, lease_terms
from resild.controller.status import answer
from resild.controller.view import NodeView, RankProgress
from resild.events.schema import Detector, EventName
from resild.membership import Membership, NodeRole
from resild.wire.channel import peer_name
from resild.wire.keys import JOINER, data_key
from resild.wire.protocol import (
    BODY_TYPES,
    Done,
    Event,
    Failed,
    Fatal,
    Health,
    Heartbeat,
    Join,
    Message,
    MsgType,
    Progress,
    ProtocolError,
    RegisterNode,
    RegisterWorker,
    StoreRequest,
    WorkerExit,
)
from resild.wire.settings import Derived

log = logging.getLogger("resild.controller")


def _size(msg: Message, typed: object) -> int:
    """About how many bytes the message makes the controller write or hold: an event's
    fields (what the event log writes), a progress report's ranks."""
    if isinstance(typed, Event):
        return len(json.dumps(typed.fields, separators=(",", ":"), default=str)) if typed.fields else 0
    if isinstance(typed, Progress):
        return 16 * len(typed.commits or {}) + len(typed.error or "")
    return 0


class Handlers:
    def __init__(self, s: ControllerState, effects: Effects, cfg: ControllerConfig, derived: Derived) -> None:
        self.s, self.effects, self.cfg, self.derived = s, effects, cfg, derived
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
            MsgType.STORE: self._on_store,
        }

    def handle(self, ident: bytes | None, msg: Message, now: float) -> None:
        s = self.s
        assert ident is not None
        typed = msg.typed
        node_id = typed.node or "" if typed is not None else str(msg.body.get("node", ""))
        node = s.view.nodes.get(node_id)
        if msg.type in (MsgType.STATUS,):
            s.ch.send(MsgType.STATUS_REPLY, answer(s, self.cfg.spare_target), to=ident)
            return
        if msg.type is MsgType.JOIN:
            self._on_join(ident, msg, now)
            return
        if node is None:
            s.ch.send(
                MsgType.ERROR, {"code": "unknown_node", "detail": f"{node_id!r} is not part of this job"}, to=ident
            )
            return
        if node.role == NodeRole.FENCED:
            node.fenced_heard_s = now  # still running: not re-admitted while it is (readmission.py)
            h = typed if isinstance(typed, Health) else None
            if h is not None and h.verdict == "failed" and node_id in s.view.strikes:
                # Fenced on suspicion, and now its own health says it is bad: drain it.
                self.effects.late_evidence(node_id, "; ".join(h.reasons or ["GPU failed"]), now)
            # A fenced node never rejoins: whatever it says, it is told to die.
            s.ch.send(MsgType.FENCE, {"reason": node.reason}, to=ident)
            return
        if msg.type in (MsgType.EVENT, MsgType.PROGRESS) and not s.budget.admit(
            node_id, msg.type.value, _size(msg, typed), now
        ):
            # Over the node's budget: counted and logged by the budget, not answered; a node
            # that stays over it is fenced.
            v = abuse_verdict(now, node_id, s.budget.overages.get(node_id, ()), self.cfg.abuse)
            if v.guilty:
                self.effects.abusive(node_id, v.reason, now)
            return
        handler = self._handlers.get(msg.type)
        if handler is None:
            s.ch.send(MsgType.ERROR, {"code": "unexpected", "detail": f"{msg.type.value} not accepted here"}, to=ident)
            return
        try:
            # decode made the typed body; a Message made some other way is validated here
            body = typed if typed is not None else BODY_TYPES[msg.type].from_dict(msg.body)
            handler(ident, node, body, now)
        except (KeyError, ValueError, TypeError, ProtocolError) as e:
            # A well-framed message with a bad body: answer and log, never crash the job.
            log.warning("bad %s body from %s: %r", msg.type.value, msg.sender, e)
            s.ch.send(MsgType.ERROR, {"code": "bad_body", "detail": f"{msg.type.value}: {e!r}"}, to=ident)

    def _on_join(self, ident: bytes, msg: Message, now: float) -> None:
        """`resil-run --join`: admitted (ADMIT) or refused with one line (ERROR "refused"),
        said on both sides; a refusal changes nothing in the job."""
        s = self.s
        if msg.sender != JOINER and not msg.sender.startswith(JOINER + "/"):
            a_reason = f"{msg.sender[:64]!r} does not hold the job's join key"
            ok = False
        else:
            b = msg.typed if isinstance(msg.typed, Join) else Join.from_dict(msg.body)
            assert isinstance(b, Join)
            a = admission(
                s.view,
                self.cfg.job_id,
                b.job or "",
                list(b.nodes or []),
                over=s.result is not None,
                keyed=s.keys is not None,
            )
            ok, a_reason = a.admit, a.reason
            if ok and not self.effects.admit(a, now, (b.source or "")[:64]):
                ok, a_reason = False, "not journaled (this controller may no longer lead): ask again"
        if not ok:
            log.warning("refused a joining node: %s", a_reason)
            s.events.emit(EventName.JOIN_REFUSED, sender=msg.sender[:128], reason=a_reason)
            s.ch.send(MsgType.ERROR, {"code": "refused", "detail": a_reason}, to=ident)
            return
        s.ch.send(MsgType.ADMIT, {"job": self.cfg.job_id, "nodes": list(a.nodes), "keys": "nodes"}, to=ident)

    def _on_register_node(self, ident: bytes, node: NodeView, b: RegisterNode, now: float) -> None:
        s = self.s
        s.node_ident[node.node_id] = ident
        node.registered, node.host_pid = True, b.pid
        s.view.beat(node.node_id, now)
        self._node_state(node, b)
        s.events.emit(EventName.NODE_REGISTERED, node=node.node_id, role=node.role.value, pid=b.pid)
        if self.derived.heartbeat_interval_s > self.cfg.settings.heartbeat_interval_s:  # the budget at this size
            s.ch.send(MsgType.WELCOME, {"heartbeat_s": self.derived.heartbeat_interval_s}, to=ident)
        if self.derived.lease_interval_s > 0:
            s.bc.send_raw(ident, s.bc.lease_frame(*lease_terms(self.cfg, self.derived)))
        m = s.view.membership
        if m is not None and node.node_id in m.node_ranks:  # a (re)started node process
            s.bc.send_view(node, ident, now)

    def _first_heard(self, ident: bytes, node: NodeView) -> None:
        """A node process first heard on this socket (a takeover, a restarted node process):
        the lease first, or whatever we send next (an INJECT, a FENCE) is dropped by a node
        still following the old leader."""
        s = self.s
        if s.node_ident.get(node.node_id) != ident:
            s.node_ident[node.node_id] = ident
            if self.derived.lease_interval_s > 0:
                s.bc.send_raw(ident, s.bc.lease_frame(*lease_terms(self.cfg, self.derived)))

    def _on_heartbeat(self, ident: bytes, node: NodeView, b: Heartbeat, now: float) -> None:
        s = self.s
        # The node daemon may heartbeat too, but the job's liveness is its node process:
        # only that one refreshes the clock and receives FENCE/INJECT/SHUTDOWN.
        if not peer_name(ident).endswith(b"/node"):
            return
        self._first_heard(ident, node)
        s.view.beat(node.node_id, now)
        node.registered = True
        if node.host_pid is None and b.pid is not None:
            node.host_pid = b.pid  # a standby that took over never saw the registration
        if b.health is not None:
            if b.health != node.health:
                node.health_reasons = ()  # a verdict with no reasons: the next HEALTH message says why
            node.health = b.health
        self._node_state(node, b)
        m = s.view.membership
        if (
            m is not None
            and node.epoch_have < m.epoch
            and b.epoch is not None
            and node.node_id in m.node_ranks
            and (b.resync or now - node.membership_sent_s > self.cfg.resync_s)
        ):
            # It missed an epoch (a lost send, a delta it could not apply): its view again.
            s.bc.send_view(node, ident, now)

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
        if b.collective_mismatch:
            cause += f" ({b.collective_mismatch})"
            self.effects.decide(on_collective_abort(self.s.view, node.node_id, b.collective_mismatch, cause), now)
            return
        self.effects.decide(
            on_node_failure(self.s.view, node.node_id, cause, Detector.PROCESS_EXIT.value, worker_fault=True), now
        )

    def _on_health(self, ident: bytes, node: NodeView, b: Health, now: float) -> None:
        node.health = b.verdict or "unknown"
        node.health_reasons = tuple(b.reasons or ()) if node.health != "healthy" else ()
        if node.health == "failed":
            reasons = b.reasons or ["GPU failed"]
            self.effects.decide(
                on_node_failure(
                    self.s.view,
                    node.node_id,
                    "; ".join(reasons),
                    b.detector if b.detector is not None else Detector.GPU_PROBE.value,
                ),
                now,
            )

    def _on_register_worker(self, ident: bytes, node: NodeView, b: RegisterWorker, now: float) -> None:
        s = self.s
        lr = b.local_rank if b.local_rank is not None else -1
        if not 0 <= lr < node.nproc:
            s.ch.send(MsgType.ERROR, {"code": "bad_local_rank", "detail": f"local rank {lr} out of range"}, to=ident)
            return
        if (node.node_id, lr) not in s.worker_ident:
            node.workers_ready += 1
            if node.role == NodeRole.ACTIVE:
                s.unregistered -= 1
        s.events.emit(EventName.WORKER_REGISTERED, node=node.node_id, local_rank=lr, pid=b.pid)
        s.worker_ident[(node.node_id, lr)] = ident
        # The node's role now: a spare's worker starts its warm-up at once (nothing else
        # tells it), an active one never fetches the recipe. One encoding per role per job.
        role = (NodeRole.SPARE if node.role == NodeRole.SPARE else NodeRole.ACTIVE).value
        welcome = s.bc.welcome_json.get(role)
        if welcome is None:
            welcome = s.bc.welcome_json[role] = json.dumps(
                {
                    **self.cfg.settings.worker_timeouts().to_dict(),
                    **self.cfg.settings.worker_redundancy().to_dict(),
                    "role": role,
                    "full_world": s.view.full_world,  # a job that shrank grows back to this width
                    # authenticates training state on the wire (launcher/worker/transport/mac.py);
                    # over CURVE only, never logged
                    **({"data_key": data_key(s.keys, self.cfg.job_id).hex()} if s.keys is not None else {}),
                },
                separators=(",", ":"),
            ).encode()
        s.bc.send_raw(ident, s.bc.frame(MsgType.WELCOME, welcome, ttl_s=10.0))
        m = s.view.membership
        if m is not None and node.node_id in m.node_ranks:
            if lr not in node.relayed:  # a relayed worker gets it from its node on its hello
                s.bc.send_layout(ident)
        elif m is None and s.unregistered <= 0:
            self.effects.start(now)

    def _on_progress(self, ident: bytes, node: NodeView, b: Progress, now: float) -> None:
        s = self.s
        if b.commits is not None:
            if peer_name(ident).endswith(b"/node"):
                # From the node process's own socket: a heartbeat too (the node sends no other
                # while its reports keep coming: relay.leader_heartbeat_due). A node that takes
                # us for the leader it already followed (a replica that led before, deposed,
                # and leads again on the same endpoint) sends nothing else: lease it now.
                self._first_heard(ident, node)
                s.view.beat(node.node_id, now)
            self._on_commits(node, b.commits, b.epoch, now, b.paces)
            if b.of:
                s.steps_planned = max(s.steps_planned, b.of)
            return
        rank, epoch, step = b.rank, b.epoch, b.step
        if rank is None or epoch is None or step is None:
            raise KeyError("rank, epoch and step are required")
        m = s.view.membership
        if m is None or m.node_ranks.get(node.node_id) is None or rank not in m.node_ranks[node.node_id]:
            return  # stale sender
        if b.state == "collective_failed" and s.view.probe_sent_s is None and epoch == m.epoch:
            s.events.emit(EventName.COLLECTIVE_FAILED, rank=rank, epoch=epoch, error=(b.error or "")[:300])
            s.view.probe_sent_s, s.view.probe_epoch = now, epoch
            targets = [n for n, v in s.view.nodes.items() if v.role == NodeRole.ACTIVE and n in s.node_ident]
            s.view.probe_targets = frozenset(targets)
            for node_id in targets:
                s.ch.send(MsgType.PING, {}, to=s.node_ident[node_id], ttl_s=1.0)
        if b.state == "joined" and epoch == m.epoch:
            # A rank finished this epoch's recovery (the spare is last: it built its model
            # first). The stall clock starts now, not at the announcement.
            s.view.epoch_started_s = max(s.view.epoch_started_s, now)
        self._rank_progress(rank, epoch, step, b.state if b.state is not None else "compute", m, now)

    def _on_commits(
        self,
        node: NodeView,
        commits: dict[int, int],
        epoch: int | None,
        now: float,
        paces: dict[int, float] | None = None,
    ) -> None:
        """A node process's aggregate of its ranks' commits: {"commits": {rank: step}, "epoch"},
        with each rank's mean pace since its last report ("paces")."""
        if epoch is None:
            raise KeyError("epoch is required with commits")
        m = self.s.view.membership
        mine = m.node_ranks.get(node.node_id) if m is not None else None
        if m is None or mine is None:
            return  # stale sender
        slowest: tuple[float, int, int] | None = None  # the node's pace is its slowest rank's
        for rank, step in commits.items():
            if rank not in mine:
                continue
            prev = self.s.view.progress.get(rank)
            if paces and rank in paces and prev is not None and prev.epoch == epoch and step > prev.step:
                if slowest is None or paces[rank] > slowest[0]:
                    slowest = (paces[rank], step, step - prev.step)
            self._rank_progress(rank, epoch, step, "commit", m, now)
        if slowest is not None and epoch == m.epoch:
            self.s.paces.add(node.node_id, epoch, slowest[1], slowest[0], slowest[2])

    def _rank_progress(self, rank: int, epoch: int, step: int, state: str, m: Membership, now: float) -> None:
        s = self.s
        p = s.view.progress.get(rank)
        if p is None:
            p = s.view.progress[rank] = RankProgress()
        committed = step > p.step or epoch != p.epoch
        p.step, p.epoch, p.state, p.t_s = step, epoch, state, now
        if state == "commit" and epoch == m.epoch:
            s.view.last_commit_s = now
            node_id = m.node_of(rank)
            if node_id is not None and step > s.node_steps.get(node_id, 0):
                s.node_steps[node_id] = step
            vouched = corroborated(s.node_steps, m.node_ranks)  # what two nodes say: one node alone raises nothing
            if vouched > s.max_step:
                s.max_step = vouched
                s.commit_times.append((vouched, now, node_id))
                s.events.progress(vouched, epoch)  # throttled: step-vs-time line, live status
            if s.awaiting_full_strength == epoch and committed:
                s.awaiting_full_strength = None
                if s.epoch_announced_s and epoch > 1:  # this job's recovery cost (stragglers.pays)
                    s.recoveries_s.append(now - s.epoch_announced_s)
                s.events.emit(EventName.FULL_STRENGTH_STEP, epoch=epoch, step=step, rank=rank)

    def _on_event(self, ident: bytes, node: NodeView, b: Event, now: float) -> None:
        fields = b.fields or {}
        m = self.s.view.membership
        if b.name == EventName.REPLICA_LAYOUT and m is not None and m.node_of(0) == node.node_id:
            # the unit a shrink drops (policy.shrink_to): said by rank 0's node only; journaled,
            # so a standby that takes over shrinks too
            unit = int(fields["unit"])
            if unit != self.s.view.replica_ranks and self.effects.journaled(ReplicaUnit(unit, time.time()), "unit"):
                self.s.view.replica_ranks = unit
        if b.name == EventName.STATE_UNVOUCHED and self.s.unvouched is None:
            self.s.unvouched = str(fields.get("reason") or "a divergence was not rolled back")  # job_finished says it
        self.s.events.emit(b.name or "worker_event", node=node.node_id, **fields)

    def _on_failed(self, ident: bytes, node: NodeView, b: Failed, now: float) -> None:
        error = b.error if b.error is not None else "an exception"
        cause = f"worker {b.local_rank} (pid {b.pid}) raised {error}"
        self.effects.decide(on_worker_exception(self.s.view, node.node_id, error, cause), now)
        self.s.view.exceptions_seen.append(error)

    def _on_fatal(self, ident: bytes, node: NodeView, b: Fatal, now: float) -> None:
        error = b.error if b.error is not None else "no reason given"
        d = on_fatal(self.s.view, node.node_id, error, self.s.fatals)  # one node's word alone ends nothing
        if node.role == NodeRole.ACTIVE:  # a spare's or a fenced node's word is not the job's
            self.s.fatals.setdefault(node.node_id, (now, error))
        self.effects.decide(d, now)

    def _on_store(self, ident: bytes, node: NodeView, b: StoreRequest, now: float) -> None:
        s = self.s
        for to, reply in s.rendezvous.handle(ident, b.__dict__, now):
            s.ch.send(MsgType.STORE_REPLY, reply, to=to)

    def _on_done(self, ident: bytes, node: NodeView, b: Done, now: float) -> None:
        s = self.s
        m = s.view.membership
        if m is None or b.epoch != m.epoch or b.rank is None:
            return  # sent before a re-form: the rank reports again in the new epoch
        if b.step is not None:  # its last commits may still sit in its node's next commit report
            self._rank_progress(b.rank, b.epoch, b.step, "commit", m, now)
        s.view.done_ranks.add(b.rank)
        if s.view.first_done_s is None:
            s.view.first_done_s = now
        s.events.emit(EventName.RANK_DONE, node=node.node_id, rank=b.rank, pid=b.pid, step=b.step)
        self.effects.decide(check_done(s.view), now)

    def _node_done(self, node: NodeView) -> bool:
        m = self.s.view.membership
        return m is not None and all(r in self.s.view.done_ranks for r in m.node_ranks.get(node.node_id, ()))
