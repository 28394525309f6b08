"""Decisions, as pure functions of (now, view): no I/O, no clock reads.

The controller executes and journals what these return; tests drive them
with a fake clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from resild.controller.budget import Overage
from resild.controller.stragglers import Straggler, pays
from resild.controller.view import ClusterView, NodeView
from resild.events.schema import Detector
from resild.membership import Membership, NodeRole
from resild.wire.settings import QUALIFY_TIMEOUT_S, Derived, JobSettings


class Action(str, Enum):
    NONE = "none"
    REPLACE_NODE = "replace_node"  # fence `node`, give its ranks to `spare`
    REFORM = "reform"  # same layout, new epoch: a transient collective failure
    DROP_SPARE = "drop_spare"  # a spare failed: fence it, no epoch change
    SHRINK = "shrink"  # fence `node`, no spare left: the survivors train on, renumbered (--min-replicas)
    GROW = "grow"  # a shrunk job takes `spare` back in: new ranks after the last one
    FAIL_JOB = "fail_job"
    FINISH = "finish"


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    node: str | None = None
    spare: str | None = None
    membership: Membership | None = None
    detector: str = ""
    # Evidence against the node itself (a health verdict, its node process or host lost):
    # only then is it drained in the scheduler. A worker's exception, exit or hang may be
    # the training script's own: the node is replaced but only suspected (drain_verdict).
    evidence: bool = True


NOTHING = Decision(Action.NONE, "")


@dataclass(frozen=True)
class Judgement:
    """A yes/no judgement with its reason (said in the events and the log)."""

    guilty: bool
    reason: str = ""


INNOCENT = Judgement(False)

# A node fenced on suspicion (no evidence) is drained at the second strike within this long:
# one exception is the script's; two on one node within the hour are the node's.
SUSPECT_WINDOW_S = 3600.0


def drain_verdict(now: float, evidence: bool, strikes: Sequence[float], window_s: float = SUSPECT_WINDOW_S) -> bool:
    """Whether a fenced node is drained (taken out of the scheduler's pool, by hand to undo):
    with evidence against it, or at a second strike: `strikes` are the times it was
    suspected before."""
    return evidence or any(now - t <= window_s for t in strikes)


_DEFAULT = JobSettings()


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's view of the job's settings (`from_settings`); its defaults are
    JobSettings' own, so every timeout has one owner."""

    heartbeat_timeout_s: float = _DEFAULT.heartbeat_timeout_s  # at scale: Derived.heartbeat_timeout_s
    hang_timeout_s: float = _DEFAULT.hang_timeout_s
    probe_timeout_s: float = 0.5  # a pinged node process must answer within this
    join_timeout_s: float = _DEFAULT.join_timeout_s
    start_heartbeat_timeout_s: float = _DEFAULT.start_heartbeat_timeout_s
    # A rank whose steps are done waits at most the collective timeout for its last disk
    # checkpoint (launcher.worker.redundancy.before_done): not hung for that long and a hang's.
    checkpoint_wait_s: float = _DEFAULT.collective_timeout_s + _DEFAULT.hang_timeout_s
    # A suspect node comes back (readmission.py) once its fenced incarnation was silent this long.
    readmit_quiet_s: float = 3 * _DEFAULT.heartbeat_timeout_s
    # A node admitted into the running job (a join, a re-admission) qualifies, then registers:
    # one that has not within this long never will, and is dropped (it would count toward
    # --spare-target forever while it could never take ranks).
    admit_register_timeout_s: float = QUALIFY_TIMEOUT_S + _DEFAULT.start_heartbeat_timeout_s

    @classmethod
    def from_settings(cls, s: JobSettings, derived: Derived) -> PolicyConfig:
        return cls(
            heartbeat_timeout_s=derived.heartbeat_timeout_s,
            hang_timeout_s=s.hang_timeout_s,
            join_timeout_s=s.join_timeout_s,
            start_heartbeat_timeout_s=s.start_heartbeat_timeout_s,
            checkpoint_wait_s=s.collective_timeout_s + s.hang_timeout_s,
            readmit_quiet_s=3 * derived.heartbeat_timeout_s,
            admit_register_timeout_s=QUALIFY_TIMEOUT_S + s.start_heartbeat_timeout_s,
        )


def pick_spare(view: ClusterView, *, starting: bool = False) -> NodeView | None:
    """Prefer a spare whose workers are all warm; else any registered spare. Before the
    first epoch (`starting`) a spare still starting up will do: it has time to register."""
    spares = [n for n in view.spares() if n.registered]
    warm = [n for n in spares if n.workers_ready >= n.nproc]
    late = [n for n in view.spares() if starting and not n.registered]
    for group in (warm, spares, late):
        if group:
            return group[0]
    return None


def on_node_failure(
    view: ClusterView, node_id: str, cause: str, detector: str, *, worker_fault: bool = False
) -> Decision:
    """`worker_fault`: the training command itself failed (a worker exited or raised),
    as opposed to the node (its node process died, went silent, or its GPU failed).
    Either way the node's ranks are replaced; only the node's own failure is evidence
    that drains it (a hang, like a worker's fault, is not: it may be the script's)."""
    d = _on_node_failure(view, node_id, cause, detector, worker_fault=worker_fault)
    if worker_fault or detector == Detector.HANG.value:
        return replace(d, evidence=False)
    return d


def _on_node_failure(view: ClusterView, node_id: str, cause: str, detector: str, *, worker_fault: bool) -> Decision:
    node = view.nodes.get(node_id)
    if node is None or node.role in (NodeRole.FENCED, NodeRole.DONE):
        return NOTHING  # already handled (several detectors often see one fault)
    if node.role == NodeRole.SPARE:
        return Decision(Action.DROP_SPARE, f"spare {node_id} failed: {cause}", node=node_id, detector=detector)
    if view.membership is None:
        if worker_fault:
            # A worker failing before the first epoch is almost always the command itself
            # (bad path, import error, bad argument): replacing nodes would repeat it.
            return Decision(
                Action.FAIL_JOB, f"{node_id} failed before the job started: {cause}", node=node_id, detector=detector
            )
        # The node itself was lost during start-up (where large jobs lose most nodes): a
        # spare takes its place in the first epoch; nothing to replay yet.
        spare = pick_spare(view, starting=True)
        if spare is None:
            return Decision(
                Action.FAIL_JOB,
                f"no spare left: {node_id} failed before the job started ({cause})",
                node=node_id,
                detector=detector,
            )
        return Decision(
            Action.REPLACE_NODE,
            f"{node_id} failed before the job started: {cause}",
            node=node_id,
            spare=spare.node_id,
            detector=detector,
        )
    spare = pick_spare(view)
    if spare is None:
        smaller = shrink_to(view, node_id)
        if smaller is not None:
            left = smaller.world_size // view.replica_ranks
            return Decision(
                Action.SHRINK,
                f"{node_id} failed ({cause}); no spare left: {left} replicas train on",
                node=node_id,
                membership=smaller,
                detector=detector,
            )
        return Decision(Action.FAIL_JOB, f"no spare left: {node_id} failed ({cause})", node=node_id, detector=detector)
    return Decision(
        Action.REPLACE_NODE,
        f"{node_id} failed: {cause}",
        node=node_id,
        spare=spare.node_id,
        membership=view.membership.replace(node_id, spare.node_id),
        detector=detector,
    )


def straggler_evidence(view: ClusterView, node_id: str) -> list[str]:
    """Pure: hardware evidence for why a node is slow: its health reasons while its verdict is
    degraded (its daemon's: clock slowdowns held over time, a PCIe link below its maximum,
    PCIe replays, ECC). Empty: none, slowness alone."""
    n = view.nodes.get(node_id)
    return list(n.health_reasons) if n is not None and n.health == "degraded" else []


def on_straggler(
    view: ClusterView, s: Straggler, act: bool, steps_left: int, recovery_s: float
) -> tuple[Decision, float]:
    """A persistently slow node (stragglers.find): replaced by a spare when `act` (--stragglers
    replace), a spare is free and it pays (stragglers.pays); else only reported. -> (the
    decision, with the reason either way; the seconds it would cost the rest of the run).
    Replaced with hardware evidence (straggler_evidence), it is drained with it; slowness
    alone is no evidence against the node: replaced, it is suspected, not drained."""
    worth, cost_s = pays(s, steps_left, recovery_s)
    evidence = straggler_evidence(view, s.node)
    why = (
        f"{s.node} is {s.slowdown:.0%} slower than the others over its last {s.steps} steps "
        f"({s.pace_s * 1000:.1f} ms a step against {s.others_s * 1000:.1f} ms)"
    )
    if evidence:
        why += f", with hardware evidence: {'; '.join(evidence)}"
    if not act:
        return Decision(Action.NONE, f"{why}: reported only (--stragglers report)", node=s.node), cost_s
    if pick_spare(view) is None:
        return Decision(Action.NONE, f"{why}: reported; no spare is free to replace it", node=s.node), cost_s
    if not worth:
        return Decision(
            Action.NONE,
            f"{why}: reported; the {steps_left} steps left would lose {cost_s:.1f}s to it, less than a recovery "
            f"costs this job ({recovery_s:.1f}s)",
            node=s.node,
        ), cost_s
    cause = (
        f"straggler: {why}; the {steps_left} steps left would lose {cost_s:.1f}s to it (a recovery: {recovery_s:.1f}s)"
    )
    return on_node_failure(view, s.node, cause, Detector.STRAGGLER.value, worker_fault=not evidence), cost_s


def shrink_to(view: ClusterView, node_id: str) -> Membership | None:
    """The epoch without `node_id` if the job may shrink (--min-replicas), the node holds whole
    replica groups (`view.replica_ranks`, said by rank 0; the workers refuse --min-replicas
    for a job where it cannot), and at least --min-replicas replicas are left; else None (the
    job stops or requeues, as without a spare)."""
    m, unit = view.membership, view.replica_ranks
    if m is None or view.min_replicas <= 0 or unit <= 0 or node_id not in m.node_ranks:
        return None
    lost = len(m.node_ranks[node_id])
    if lost % unit or m.world_size % unit:
        return None
    left = (m.world_size - lost) // unit
    return m.shrink(node_id) if left >= view.min_replicas and left > 0 else None


def check_grow(view: ClusterView, busy: bool) -> Decision:
    """A shrunk job grows back one node at a time, with a warm spare whose ranks keep it within
    its full width, once its last recovery is over (`busy`: an epoch not yet at full strength).
    The new epoch abandons the step in flight (nothing committed is lost); the newcomer gets
    the state by replay like any spare."""
    m, unit = view.membership, view.replica_ranks
    if busy or m is None or view.min_replicas <= 0 or unit <= 0 or m.world_size >= view.full_world:
        return NOTHING
    for n in view.spares():
        fits = n.nproc % unit == 0 and m.world_size + n.nproc <= view.full_world
        if n.registered and n.workers_ready >= n.nproc and fits:
            bigger = m.grow(n.node_id, n.nproc)
            return Decision(
                Action.GROW,
                f"{n.node_id} joins: {bigger.world_size // unit} of {view.full_world // unit} replicas",
                spare=n.node_id,
                membership=bigger,
            )
    return NOTHING


AFTER_RECOVERY_STEPS = 3  # steps after an epoch's floor within which a mismatch is the newcomer's


def on_collective_abort(view: ClusterView, node_id: str, line: str, cause: str) -> Decision:
    """A worker was killed from inside its backend for a collective mismatch (its last
    output says so: launcher/node/worker_output.py). Right after a recovery (within
    AFTER_RECOVERY_STEPS of the epoch's committed floor) it is a program error that
    differs on a fresh process: stop the job with the line instead of replacing a healthy
    node (and spending a spare on it). Otherwise, a node failure like any worker exit."""
    m = view.membership
    newest = max((p.step for p in view.progress.values()), default=0)
    if m is not None and m.epoch > 1 and newest <= m.committed + AFTER_RECOVERY_STEPS:
        return Decision(
            Action.FAIL_JOB,
            f"collective mismatch right after a recovery (epoch {m.epoch}, step {newest}): {cause}. The ranks "
            "issued different collectives: a program error, not a fault, so the job stops instead of replacing "
            "healthy nodes (RESILD_CHECK_COLLECTIVES=1 names the first differing collective)",
            node=node_id,
            detector=Detector.PROCESS_EXIT.value,
        )
    return on_node_failure(view, node_id, cause, Detector.PROCESS_EXIT.value, worker_fault=True)


def on_worker_exception(view: ClusterView, node_id: str, error: str, cause: str) -> Decision:
    """A worker raised. The first time it is treated like a node fault (a bad GPU
    often surfaces as an exception); the same error again, on another node, is a
    bug in the training script: replacing nodes would only burn the spares."""
    if error and error in view.exceptions_seen:
        return Decision(
            Action.FAIL_JOB,
            f"the same exception recurred on {node_id} after a node replacement; "
            f"this looks like a bug in the training script, not a fault: {error}",
            node=node_id,
            detector=Detector.EXCEPTION.value,
        )
    return on_node_failure(view, node_id, cause, Detector.EXCEPTION.value, worker_fault=True)


def check_probe(now: float, view: ClusterView, cfg: PolicyConfig) -> Decision:
    """A rank saw a collective fail (a peer's socket reset): every active node was
    pinged at `probe_sent_s`. One that has not answered within probe_timeout_s is
    dead; this beats waiting for the heartbeat timeout by a second or more."""
    sent = view.probe_sent_s
    if sent is None or now - sent < cfg.probe_timeout_s:
        return NOTHING
    for node_id in sorted(view.probe_targets):
        node = view.nodes[node_id]
        if node.role == NodeRole.ACTIVE and node.last_heartbeat_s < sent:
            return on_node_failure(
                view,
                node_id,
                f"no answer to a liveness probe within {cfg.probe_timeout_s:.1f}s after a collective failed",
                "probe",
            )
    m = view.membership
    if m is not None and m.epoch == view.probe_epoch:
        # Everyone is alive and nobody was replaced meanwhile: the failure was transient
        # (a reset connection). Re-form, or the ranks would wait for a notice forever.
        return Decision(
            Action.REFORM,
            f"a collective failed in epoch {m.epoch} but every node answered the liveness probe: re-forming the group",
            membership=m.bump(),
            detector=Detector.PROBE.value,
        )
    return NOTHING


STALL_S = 0.5  # a tick this late means the controller itself did not run


def tick_interval_s(view: ClusterView, busy: bool, tick_s: float, idle_tick_s: float) -> float:
    """Time to the next timeout check. Fast while the job starts, recovers (until its
    first full-strength commit), probes its nodes, or has work queued (`busy`): those
    checks are on a recovery's path. A steady job's checks are against timeouts of
    seconds (heartbeats, hangs, leases), and each wake-up of an embedded controller
    takes a core from the trainers beside it, so it checks every `idle_tick_s`.
    Messages (a worker's exit, a failed collective) are handled as they come either way."""
    if busy or view.membership is None or view.probe_sent_s is not None:
        return tick_s
    return max(tick_s, idle_tick_s)


def controller_stall_s(now: float, tick_due_s: float) -> float:
    """How long the controller itself did not run before this tick (0 when on time). Time
    nobody watched must not count against the nodes: a leader resumed after a SIGSTOP
    saw every heartbeat "missing" and fenced a healthy node."""
    late_s = now - tick_due_s
    return late_s if tick_due_s > 0 and late_s > STALL_S else 0.0


def check_timeouts(now: float, view: ClusterView, cfg: PolicyConfig) -> Decision:
    """Probe answers first, then heartbeat loss (a dead node explains a stall), then hangs."""
    d = check_probe(now, view, cfg)
    if d.action != Action.NONE:
        return d
    d = check_heartbeats(now, view, cfg)
    if d.action != Action.NONE:
        return d
    d = check_admitted(now, view, cfg)
    if d.action != Action.NONE:
        return d
    return check_hang(now, view, cfg)


def check_heartbeats(now: float, view: ClusterView, cfg: PolicyConfig) -> Decision:
    """A registered node silent for heartbeat_timeout_s is lost (before the first epoch:
    start_heartbeat_timeout_s, if longer)."""
    timeout_s = cfg.heartbeat_timeout_s
    if view.membership is None:
        timeout_s = max(timeout_s, cfg.start_heartbeat_timeout_s)
    for node in view.by_heartbeat():  # oldest first: stop at the first live one
        if node.registered and node.role in (NodeRole.ACTIVE, NodeRole.SPARE):
            silent_s = now - node.last_heartbeat_s
            if silent_s > timeout_s:
                return on_node_failure(
                    view, node.node_id, f"no heartbeat for {silent_s:.1f}s", Detector.HEARTBEAT.value
                )
            break
    return NOTHING


def check_admitted(now: float, view: ClusterView, cfg: PolicyConfig) -> Decision:
    """A spare admitted into the running job that has not registered within
    admit_register_timeout_s of its admission is dropped (start-up spares are the start's)."""
    for node in view.spares():
        if node.registered or node.admitted_s is None:
            continue
        waited_s = now - node.admitted_s
        if waited_s > cfg.admit_register_timeout_s:
            return on_node_failure(
                view,
                node.node_id,
                f"admitted {waited_s:.0f}s ago, it never registered (qualification and start-up "
                f"take at most {cfg.admit_register_timeout_s:.0f}s)",
                Detector.HEARTBEAT.value,
            )
    return NOTHING


def check_hang(now: float, view: ClusterView, cfg: PolicyConfig) -> Decision:
    """A stalled job: nobody committed for hang_timeout_s. The culprits are the
    ranks NOT blocked in a collective (they are what the others wait for)."""
    m = view.membership
    if m is None or view.last_commit_s == 0.0:
        return NOTHING  # start-up (imports, model build, first formation): the start timeout governs it
    since = max(view.last_commit_s, view.epoch_started_s, view.first_done_s or 0.0)
    stalled_s = now - since
    if stalled_s <= cfg.hang_timeout_s:
        return NOTHING
    excused = False
    for rank in range(m.world_size):
        if rank in view.done_ranks:
            continue  # finished: waiting for the others is all it does
        p = view.progress.get(rank)
        if p is not None and p.epoch == m.epoch and p.state == "join" and now - p.t_s <= cfg.join_timeout_s:
            excused = True  # a spare building its model for the failed ranks: the others wait for it
            continue
        if p is not None and p.epoch == m.epoch and p.state == "checkpoint" and now - p.t_s <= cfg.checkpoint_wait_s:
            excused = True  # its steps are done; its last disk checkpoint is still being written
            continue
        if p is None or p.epoch != m.epoch or p.state not in ("wait", "collective_failed"):
            node = m.node_of(rank)
            assert node is not None
            last = "never reported" if p is None else f"last step {p.step}, state {p.state}"
            return on_node_failure(
                view, node, f"hang: rank {rank} made no progress for {stalled_s:.1f}s ({last})", Detector.HANG.value
            )
    if stalled_s > 2 * cfg.hang_timeout_s and not excused:
        reformed = view.stall_reformed_s
        if reformed is not None and reformed >= view.last_commit_s:
            return Decision(
                Action.FAIL_JOB,
                f"job stalled {stalled_s:.1f}s with every rank waiting in a collective, again after a re-form "
                "with no commit between; no culprit to replace",
            )
        # Every rank waits on a connection that stays silent (one a stranger took over, a
        # stuck peer socket) before the collective timeout (3 hang timeouts) says so: new
        # connections, the same ranks. A deadlock in the training script stalls again, and
        # the second stall with no commit since ends the job.
        return Decision(
            Action.REFORM,
            f"job stalled {stalled_s:.1f}s with every rank waiting in a collective and no culprit: "
            "re-forming the group once",
            membership=m.bump(),
            detector=Detector.HANG.value,
        )
    return NOTHING


def check_done(view: ClusterView) -> Decision:
    m = view.membership
    if m is not None and len(view.done_ranks) == m.world_size:
        return Decision(Action.FINISH, f"all {m.world_size} ranks finished")
    return NOTHING


# ---- the controller's own errors (errors.py, loop.py) ----------------------------------
def give_up_verdict(now: float, failing_since_s: float | None, limit_s: float) -> Judgement:
    """Whether the controller stops on its own error: its tick has failed on every round
    since `failing_since_s` (None: the last round went through) for `limit_s` or longer.
    That long it could not detect failures (or send leases, or expire rendezvous): a new
    leader, or the nodes' lease rules, do better than a blind controller. It stops without
    a SHUTDOWN (no verdict: the job is not over). A message handler's errors never count:
    a key holder's crafted message must not be able to stop the controller."""
    if failing_since_s is None or limit_s <= 0 or now - failing_since_s < limit_s:
        return INNOCENT
    return Judgement(True, f"the controller's tick failed on every round for {now - failing_since_s:.1f}s")


# ---- a node that stays over its message budget (budget.py) -----------------------------
@dataclass(frozen=True)
class AbuseLimits:
    """When a node over its EVENT/PROGRESS budget is abusive, not just loud: messages were
    dropped in at least `intervals` of the budget's intervals (1 s, aligned on the clock)
    within the last `window_s`, and at least `messages` of them, or `bytes` bytes, in that
    window. n intervals take a flood more than n - 2 of them to touch (it may begin at the
    end of one). Far above what an honest node does: its events are rare, its progress far
    under its budget; a burst (a recovery's catch-up) touches one or two intervals, not six."""

    window_s: float = 10.0
    intervals: int = 6
    messages: int = 1000
    bytes: int = 64 << 20


def abuse_verdict(now: float, node: str, overages: Sequence[Overage], limits: AbuseLimits) -> Judgement:
    """Whether `node` is abusive now, from its intervals with drops (budget.Overage)."""
    recent = [o for o in overages if now - o.start_s < limits.window_s]
    messages = sum(o.messages for o in recent)
    nbytes = sum(o.bytes for o in recent)
    if len(recent) < limits.intervals or (messages < limits.messages and nbytes < limits.bytes):
        return INNOCENT
    return Judgement(
        True,
        f"abuse: {node} stayed over its message budget: messages dropped in {len(recent)} intervals within "
        f"{limits.window_s:g}s ({messages} messages, {nbytes} bytes)",
    )


def on_abuse(view: ClusterView, node_id: str, reason: str) -> Decision:
    """An abusive node is fenced like a failed one: its ranks go to a spare, and it is
    drained (its key holder is hostile: evidence against the node). Unless that would end
    the job (no spare left): the job does not pay for one node's flood; the node stays in,
    its messages over budget dropped (what keeps the controller whole), named again later."""
    d = on_node_failure(view, node_id, reason, "abuse")
    return NOTHING if d.action in (Action.FAIL_JOB, Action.SHRINK) else d  # nor does it shrink for it
