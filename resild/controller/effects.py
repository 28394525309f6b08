"""Carrying out the controller's decisions: journal first, then the I/O.

A policy decision (fence and replace a node, re-form, fail or finish the job), the
first epoch, a new epoch announced, the faults due, and the end of the job (SHUTDOWN
to everyone still in it, the backend's shutdown: only with the job's verdict). Once a decision is journaled, its
new epoch is sent before anything else is done about it (fencing, events): the
announcement is the recovery's critical path. Reads and writes the shared
ControllerState; makes no decisions of its own (those come from `policy`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from statistics import median

from resild.controller.admission import Admission
from resild.controller.broadcast import Announced
from resild.controller.faults import Injector
from resild.controller.policy import Action, Decision, drain_verdict, on_abuse
from resild.controller.readmission import Readmission
from resild.controller.records import Admit, FaultFired, Readmit, Record, Start, decided
from resild.controller.state import ControllerConfig, ControllerState
from resild.controller.view import JobResult, NodeView
from resild.events.schema import Detector, EventName
from resild.membership import Membership, NodeRole
from resild.wire.keys import add_node_key
from resild.wire.protocol import MsgType

log = logging.getLogger("resild.controller")

ABUSE_RENAME_S = 60.0  # an abusive node that could not be fenced is named again this often


MIN_STEP_PAIRS = 3  # fewer consecutive-step pairs than this are chance, not a step time


def median_step_s(commit_times: list[tuple[int, float, str | None]]) -> float | None:
    """The median step time from (step, t, node) points, one per advance of the job's step.
    Only one node's consecutive steps count: step s from one node's report and s+1 from
    another's a few ms later is reporting skew, not a step (seen: 4.5 ms for 16 ms steps).
    Commits are reported at most every 0.1 s (node processes and workers coalesce them), so
    steps much shorter than that leave no such pair, or one by chance (a worker's event
    sends its pending commit at once, the next report comes 0.1 s later: seen after a
    spare's first step, 0.1 s for 10 ms steps): with fewer than MIN_STEP_PAIRS, None, and
    the report uses its own rate."""
    times = [t2 - t1 for (s1, t1, n1), (s2, t2, n2) in zip(commit_times, commit_times[1:]) if s2 == s1 + 1 and n1 == n2]
    return median(times) if len(times) >= MIN_STEP_PAIRS else None


class Effects:
    def __init__(self, s: ControllerState, cfg: ControllerConfig, injector: Injector) -> None:
        self.s, self.cfg, self.injector = s, cfg, injector

    def decide(self, d: Decision, now: float) -> None:
        s = self.s
        if d.action == Action.NONE:
            return
        if d.membership is not None:  # the committed floor travels with the epoch (and its journal record)
            d = replace(d, membership=d.membership.with_committed(s.max_step))
        if not self.journaled(decided(d, s.max_step, time.time()), d.reason):
            if d not in s.deferred_decisions and len(s.deferred_decisions) < 64:
                s.deferred_decisions.append(d)  # a message's decision: no tick would make it again
            return
        failed = d.action in (Action.REPLACE_NODE, Action.DROP_SPARE, Action.SHRINK, Action.FAIL_JOB) and d.node
        if failed:
            self.injector.settled()  # a fault's failure was seen (a spare's brings no new epoch)
            s.events.emit(
                EventName.FAILURE_DETECTED,
                node=d.node,
                cause=d.reason,
                detector=d.detector,
                committed_step=s.max_step,
            )
        sent: Announced | None = None
        was = s.view.membership.world_size if s.view.membership is not None else 0
        if d.action in (Action.REPLACE_NODE, Action.SHRINK, Action.GROW, Action.REFORM) and d.membership is not None:
            # Journaled: the new epoch goes out first; fencing the failed node (it is not
            # in the new epoch, so it hears nothing of it) and the events follow.
            if d.spare:
                s.view.nodes[d.spare].set_role(NodeRole.ACTIVE)
            sent = self.announce(d.membership, now)
        if failed:
            assert d.node
            self.fence(d.node, d.reason, now, d.evidence)
        if d.action == Action.REPLACE_NODE and d.membership is None:
            # Before the first epoch: the spare takes the failed node's place in it.
            assert d.node and d.spare
            s.view.nodes[d.spare].set_role(NodeRole.ACTIVE)
            s.initial = s.initial.replace(d.node, d.spare, next_epoch=False)
            s.unregistered = sum(
                max(0, s.view.nodes[n].nproc - s.view.nodes[n].workers_ready) for n in s.initial.node_ranks
            )
            s.events.emit(
                EventName.SPARE_ASSIGNED,
                spare=d.spare,
                failed=d.node,
                epoch=s.initial.epoch,
                ranks=list(s.initial.node_ranks[d.spare]),
                spares_left=len(s.view.spares()),
                before_start=True,
            )
            if s.unregistered <= 0:
                self.start(now)
        elif d.action == Action.REPLACE_NODE:
            assert d.spare and d.membership and sent
            s.events.emit(
                EventName.SPARE_ASSIGNED,
                spare=d.spare,
                failed=d.node,
                epoch=d.membership.epoch,
                ranks=list(d.membership.node_ranks[d.spare]),
                spares_left=len(s.view.spares()),
            )
            self.announced(d.membership, sent, now)
        elif d.action in (Action.SHRINK, Action.GROW):
            assert d.membership is not None and sent
            m = d.membership
            s.events.emit(
                EventName.JOB_RESIZED,
                how=d.action.value,
                node=d.node or d.spare,
                epoch=m.epoch,
                world_size=m.world_size,
                was=was,
                full=s.view.full_world,
                ranks=list(m.node_ranks[d.spare]) if d.spare else None,
                spares_left=len(s.view.spares()),
                reason=d.reason,
            )
            self.announced(m, sent, now)
        elif d.action == Action.REFORM:
            assert d.membership is not None and sent
            if d.detector == Detector.HANG.value:  # a stall answered with a re-form: once per commit
                s.view.stall_reformed_s = now
            s.events.emit(EventName.REFORM, epoch=d.membership.epoch, reason=d.reason)
            self.announced(d.membership, sent, now)
        elif d.action == Action.FAIL_JOB:
            s.events.emit(EventName.JOB_FAILED, reason=d.reason)
            s.result = JobResult(1, d.reason)
        elif d.action == Action.FINISH:
            ct = s.commit_times
            train_s = ct[-1][1] - ct[0][1] if len(ct) > 1 else 0.0
            s.events.emit(
                EventName.JOB_FINISHED,
                reason=d.reason,
                step=ct[-1][0] - ct[0][0] if ct else 0,
                final_step=s.max_step,
                train_s=train_s,
                step_s=median_step_s(ct),
                unvouched=s.unvouched,
            )
            s.result = JobResult(0, d.reason)

    def admit(self, a: Admission, now: float, source: str = "") -> bool:
        """Joining nodes become spares: journaled, then each gets its own key (minted in the
        job's key directory; the authenticator reads it at the node's first connection) and
        a place in the view. Their workers warm up as the start-up spares' do, on registering."""
        s = self.s
        assert s.keys is not None and a.admit
        if not self.journaled(Admit(a.nodes, a.reason, time.time()), a.reason):
            return False
        for n in a.nodes:
            add_node_key(s.keys, n)
            s.view.add(NodeView(n, NodeRole.SPARE, s.bc.nproc), now)
            s.events.emit(EventName.NODE_ADMITTED, node=n, via="join", source=source, spares=len(s.view.spares()))
        if source:
            s.joined_sources.add(source)
        return True

    def readmit(self, r: Readmission, now: float) -> None:
        """A suspect node back as a spare: journaled, a new key (whatever is left of its old
        incarnation can no longer connect), a fresh view of it, and a new node process that
        qualifies before it registers (the backend's)."""
        s = self.s
        if not self.journaled(Readmit(r.node, r.reason, time.time()), r.reason):
            return
        old = s.view.nodes[r.node]
        old.set_role(NodeRole.SPARE)
        fresh = NodeView(r.node, NodeRole.SPARE, old.nproc, last_heartbeat_s=old.last_heartbeat_s, admitted_s=now)
        s.view.nodes[r.node] = fresh
        s.node_ident.pop(r.node, None)
        for lr in range(old.nproc):
            s.worker_ident.pop((r.node, lr), None)
        if s.keys is not None:
            add_node_key(s.keys, r.node)
        s.backend.readmit(r.node)
        s.events.emit(EventName.NODE_READMITTED, node=r.node, reason=r.reason, spares=len(s.view.spares()))

    def journaled(self, record: Record, what: str) -> bool:
        """Write ahead. False: a replicated journal did not commit the record, so this
        replica may no longer lead (deposed while it was stalled, or without a majority):
        nothing of it is carried out, and the policy decides again at the next tick, here
        or at the new leader. (An embedded journal's failed write is a full disk: the job
        goes on without durability; see `Journal`.)"""
        s = self.s
        if s.journal.append(record) or not s.journal.replicated:
            return True
        s.deferred += 1
        log.error("not carried out, the replicas did not commit it (no longer the leader?): %s", what)
        return False

    def abusive(self, node_id: str, reason: str, now: float) -> None:
        """A node judged abusive (policy.abuse_verdict): fenced through the failure path
        (its ranks to a spare) and named; with no spare left it stays in (policy.on_abuse),
        named again at most every ABUSE_RENAME_S."""
        s = self.s
        d = on_abuse(s.view, node_id, reason)
        if d.action == Action.NONE and now - s.abusive.get(node_id, -1e9) < ABUSE_RENAME_S:
            return
        s.abusive[node_id] = now
        self.decide(d, now)  # the new epoch first, as for any failure
        fenced = d.action != Action.NONE
        log.error("%s%s", reason, "" if fenced else ": no spare left, kept (its messages over budget dropped)")
        s.events.emit(
            EventName.NODE_ABUSIVE,
            node=node_id,
            reason=reason,
            fenced=fenced,
            dropped=s.budget.dropped.get(node_id, 0),
        )

    def retry_deferred(self, now: float) -> None:
        """Decisions the replicas did not commit, tried again while they still fit the view
        (same epoch, the node not fenced yet, the spare still free); otherwise dropped: the
        world moved on and the policy decides afresh."""
        s = self.s
        todo, s.deferred_decisions = s.deferred_decisions, []
        epoch = s.view.membership.epoch if s.view.membership else 0
        for d in todo:
            if d.membership is not None and d.membership.epoch != epoch + 1:
                continue
            if d.node and s.view.nodes[d.node].role == NodeRole.FENCED:
                continue
            if d.spare and s.view.nodes[d.spare].role != NodeRole.SPARE:
                continue
            if s.result is None:
                self.decide(d, now)

    def fence(self, node_id: str, reason: str, now: float, evidence: bool = True) -> None:
        s = self.s
        node = s.view.nodes[node_id]
        node.set_role(NodeRole.FENCED, reason)
        if node_id in s.node_ident:
            s.ch.send(MsgType.FENCE, {"reason": reason}, to=s.node_ident[node_id])
        s.backend.fence(node_id, reason)
        strikes = s.view.strikes.get(node_id, [])
        drained = drain_verdict(now, evidence, strikes, self.cfg.suspect_window_s)
        if drained:
            self.drain(node_id, reason)
        else:  # a worker's failure without evidence: out of this job, not out of the pool
            s.view.strikes.setdefault(node_id, []).append(now)
            s.events.emit(EventName.NODE_SUSPECT, node=node_id, reason=reason, strikes=len(strikes) + 1)
        s.events.emit(EventName.NODE_FENCED, node=node_id, reason=reason, drained=drained)

    def drain(self, node_id: str, reason: str) -> None:
        if node_id not in self.s.view.drained:
            self.s.view.drained.add(node_id)
            self.s.backend.drain(node_id, reason)

    def late_evidence(self, node_id: str, reason: str, now: float) -> None:
        """Evidence against a node already fenced on suspicion (its daemon's health verdict
        arrives after its worker failed): the second strike, drained now."""
        s = self.s
        if node_id in s.view.drained or not drain_verdict(
            now, True, s.view.strikes.get(node_id, []), self.cfg.suspect_window_s
        ):
            return
        self.drain(node_id, reason)
        strikes = len(s.view.strikes.get(node_id, [])) + 1
        s.events.emit(EventName.NODE_SUSPECT, node=node_id, reason=reason, strikes=strikes, drained=True)

    def start(self, now: float) -> None:
        """Every active worker registered: the first epoch, journaled like any decision
        (not committed: the tick tries again)."""
        if self.s.view.membership is not None:
            return
        if self.journaled(Start(self.s.initial, "every active worker registered", time.time()), "the first epoch"):
            self.apply_membership(self.s.initial, now)

    def apply_membership(self, m: Membership, now: float) -> None:
        """Epoch `m` (already journaled) out to the nodes, then its event."""
        self.announced(m, self.announce(m, now), now)

    def announce(self, m: Membership, now: float) -> Announced:
        """The new epoch becomes the view's and goes out: how, and what it took."""
        s = self.s
        t0, cpu0 = time.perf_counter(), time.thread_time()
        prev = s.view.membership
        s.view.membership = m
        s.view.done_ranks.clear()  # ranks re-report done in the new epoch
        s.view.first_done_s = None
        s.view.epoch_started_s = now
        s.awaiting_full_strength = m.epoch
        self.injector.settled()
        sent = s.bc.announce(m, prev, now)
        return replace(sent, seconds=time.perf_counter() - t0, cpu_s=time.thread_time() - cpu0)

    def announced(self, m: Membership, sent: Announced, now: float) -> None:
        """After the sends: the epoch's event (its whole layout, O(ranks)), the faults it arms."""
        self.s.epoch_announced_s = now
        self.s.events.emit(
            EventName.MEMBERSHIP,
            epoch=m.epoch,
            layout={n: list(r) for n, r in m.node_ranks.items()},
            committed=m.committed,
            view=sent.view,
            delta=sent.delta,
            direct=sent.direct,
            announce_s=round(sent.seconds, 6),
            announce_cpu_s=round(sent.cpu_s, 6),
        )
        self.fire_faults(now)  # faults armed on this epoch hit during the recovery itself

    def fire_faults(self, now: float) -> None:
        s = self.s
        epoch = s.view.membership.epoch if s.view.membership else 0
        # A recovery or a leader's takeover under way: step faults wait for full strength
        # (faults meant to hit a recovery are armed on its epoch: KIND:NODE@eN).
        busy = s.awaiting_full_strength is not None
        for f in self.injector.due(s.max_step, now, epoch, busy):
            target = s.view.nodes.get(f.node)
            if target is not None and target.role == NodeRole.FENCED:  # it can never hit: dropped
                log.warning("fault %s dropped: %s is fenced", f, f.node)
                continue
            if f.kind in ("corrupt", "slow"):  # every worker of the node (snapshot copies; its pace)
                targets = [(wid, lr) for (node_id, lr), wid in list(s.worker_ident.items()) if node_id == f.node]
            elif f.kind in ("exception", "diverge", "badgrad"):
                wid = s.worker_ident.get((f.node, f.local_rank))
                targets = [] if wid is None else [(wid, f.local_rank)]
            else:
                ident = s.node_ident.get(f.node)
                targets = [] if ident is None else [(ident, f.local_rank)]
            if not targets:  # not (yet) connected to this leader: a fault never lost unfired
                self.injector.rearm(f)
                continue
            if not self.journaled(FaultFired(str(f), time.time()), f"fault {f}"):  # fired once, ever
                self.injector.rearm(f)
                continue
            self.injector.fired(f, now)
            s.events.emit(EventName.FAULT_INJECTED, kind=f.kind, node=f.node, step=s.max_step, spec=str(f))
            for to, lr in targets:
                s.ch.send(MsgType.INJECT, {"kind": f.kind, "local_rank": lr, "xid": f.xid, "pct": f.pct}, to=to)

    def finish(self) -> None:
        """The end of the job, with its verdict (finished, failed, or cancelled: Ctrl-C):
        SHUTDOWN to every node process and direct worker still in it, then the backend's
        shutdown. Never without a verdict: a controller that failed on its own, or a deposed
        leader, says nothing (the nodes keep training, and follow the next leader)."""
        s = self.s
        if s.result is None:
            log.error("no verdict: no SHUTDOWN sent, the backend left running")
            return
        for node_id, ident in s.node_ident.items():
            if s.view.nodes[node_id].role != NodeRole.FENCED:
                s.ch.send(MsgType.SHUTDOWN, {"reason": s.result.reason, "exit_code": s.result.exit_code}, to=ident)
        for (node_id, lr), ident in s.worker_ident.items():
            node = s.view.nodes[node_id]
            if node.role != NodeRole.FENCED and lr not in node.relayed:  # relayed ones hear it from their node
                s.ch.send(MsgType.SHUTDOWN, {"reason": s.result.reason, "exit_code": s.result.exit_code}, to=ident)
        if self.cfg.wait_nodes_gone_s > 0:
            self.wait_nodes_gone(self.cfg.shutdown_timeout_s if s.result.exit_code == 0 else 10.0)
        s.backend.shutdown(self.cfg.shutdown_timeout_s if s.result.exit_code == 0 else 0.0)

    def wait_nodes_gone(self, timeout_s: float) -> None:
        """Without a backend that sees node processes (a standby leader under Slurm), the
        job is over once they stop heartbeating: their workers may still be saving."""
        t0 = last = time.monotonic()
        while (now := time.monotonic()) - t0 < timeout_s and now - last < self.cfg.wait_nodes_gone_s:
            got = self.s.ch.recv(0.1)
            if got is not None and got[1].type == MsgType.HEARTBEAT and got[1].sender.endswith("/node"):
                last = time.monotonic()
