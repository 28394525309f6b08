"""Pure policy tests: an injected clock, no sockets, no processes."""

from __future__ import annotations

import pytest

from resild.controller.budget import Budget, Limits
from resild.controller.policy import (
    AbuseLimits,
    Action,
    Judgement,
    PolicyConfig,
    abuse_verdict,
    check_done,
    check_grow,
    check_timeouts,
    on_abuse,
    on_collective_abort,
    on_node_failure,
    on_worker_exception,
    pick_spare,
    tick_interval_s,
)
from resild.controller.view import ClusterView, NodeView, RankProgress
from resild.membership import IllegalTransition, Membership, NodeRole

CFG = PolicyConfig(heartbeat_timeout_s=2.0, hang_timeout_s=5.0)


def view(now: float = 100.0, spares: int = 1, warm: bool = True) -> ClusterView:
    nodes = {
        n: NodeView(n, NodeRole.ACTIVE, 2, registered=True, last_heartbeat_s=now, workers_ready=2) for n in ("a", "b")
    }
    for i in range(spares):
        nodes[f"s{i}"] = NodeView(
            f"s{i}", NodeRole.SPARE, 2, registered=True, last_heartbeat_s=now, workers_ready=2 if warm else 0
        )
    v = ClusterView(nodes, Membership.initial(["a", "b"], 2), epoch_started_s=now, last_commit_s=now)
    for r in range(4):
        v.progress[r] = RankProgress(step=10, epoch=1, state="commit", t_s=now)
    return v


def beat(v: ClusterView, now: float) -> ClusterView:
    for n in v.nodes:
        v.beat(n, now)
    return v


def test_failure_with_spare_moves_exactly_the_failed_ranks() -> None:
    d = on_node_failure(view(), "b", "worker exited", "process-exit")
    assert d.action == Action.REPLACE_NODE and d.spare == "s0"
    assert d.membership == Membership(2, 4, {"a": (0, 1), "s0": (2, 3)})
    assert "b failed: worker exited" in d.reason


def test_no_spare_fails_the_job_with_a_reason() -> None:
    d = on_node_failure(view(spares=0), "a", "Xid 79", "gpu-probe")
    assert d.action == Action.FAIL_JOB
    assert d.reason == "no spare left: a failed (Xid 79)"


def test_second_report_of_the_same_fault_is_ignored() -> None:
    v = view()
    v.nodes["b"].set_role(NodeRole.FENCED)
    assert on_node_failure(v, "b", "again", "heartbeat").action == Action.NONE


def test_a_failed_spare_is_dropped_without_a_new_epoch() -> None:
    d = on_node_failure(view(), "s0", "exited", "process-exit")
    assert d.action == Action.DROP_SPARE and d.membership is None


def test_warm_spare_is_preferred() -> None:
    v = view(spares=2)
    v.nodes["s0"].workers_ready = 1
    assert pick_spare(v).node_id == "s1"


def test_heartbeat_loss_after_timeout_only() -> None:
    v = view(now=100.0)
    v.beat("a", 99.0)
    assert check_timeouts(101.0, v, CFG).action == Action.NONE  # 2.0 s silent: not yet
    d = check_timeouts(101.5, v, CFG)  # 2.5 s silent
    assert d.action == Action.REPLACE_NODE and d.node == "a" and d.detector == "heartbeat"


def test_hang_blames_the_rank_that_is_not_waiting() -> None:
    v = view(now=100.0)
    for r in (0, 1, 3):
        v.progress[r].state = "wait"
    assert check_timeouts(104.0, beat(v, 104.0), CFG).action == Action.NONE
    d = check_timeouts(106.0, beat(v, 106.0), CFG)
    assert d.action == Action.REPLACE_NODE and d.node == "b" and d.detector == "hang"
    assert "rank 2" in d.reason


def test_hang_clock_restarts_with_each_epoch() -> None:
    v = view(now=100.0)
    v.epoch_started_s = 105.0
    assert check_timeouts(106.0, beat(v, 106.0), CFG).action == Action.NONE


def test_stall_with_everyone_waiting_reforms_once_then_fails_cleanly_instead_of_hanging() -> None:
    """Every rank waiting on a silent connection (a stranger holding a gloo connection, issue
    39 finding 1: the job used to fail) gets new connections once; a second such stall
    with no commit since (a deadlock in the script) ends the job; a commit between earns
    another re-form."""
    v = view(now=100.0)
    for p in v.progress.values():
        p.state = "wait"
    assert check_timeouts(106.0, beat(v, 106.0), CFG).action == Action.NONE
    d = check_timeouts(111.0, beat(v, 111.0), CFG)
    assert d.action == Action.REFORM and d.detector == "hang" and d.node is None, d
    assert d.membership is not None and v.membership is not None
    assert d.membership.epoch == v.membership.epoch + 1 and d.membership.node_ranks == v.membership.node_ranks
    v.stall_reformed_s = 111.0  # effects: the re-form went out
    v.membership, v.epoch_started_s = d.membership, 111.0
    for p in v.progress.values():
        p.epoch, p.state = d.membership.epoch, "wait"
    assert check_timeouts(120.0, beat(v, 120.0), CFG).action == Action.NONE
    again = check_timeouts(122.0, beat(v, 122.0), CFG)
    assert again.action == Action.FAIL_JOB and "again after a re-form" in again.reason, again
    v.last_commit_s = 125.0  # progress after the re-form: a later stall is a new one
    assert check_timeouts(136.0, beat(v, 136.0), CFG).action == Action.REFORM


def test_done_when_every_rank_reported() -> None:
    v = view()
    v.done_ranks = {0, 1, 2}
    assert check_done(v).action == Action.NONE
    v.done_ranks.add(3)
    assert check_done(v).action == Action.FINISH


def test_role_transitions_are_enforced() -> None:
    n = NodeView("x", NodeRole.ACTIVE, 1)
    n.set_role(NodeRole.FENCED)
    with pytest.raises(IllegalTransition):
        n.set_role(NodeRole.ACTIVE)  # a fenced node never comes back


def test_membership_replace_rejects_nonsense() -> None:
    m = Membership.initial(["a", "b"], 1)
    with pytest.raises(KeyError):
        m.replace("zz", "s")
    with pytest.raises(ValueError):
        m.replace("a", "b")
    assert Membership.from_dict(m.to_dict()) == m


def test_probe_unanswered_by_the_deadline_fails_that_node_only() -> None:
    v = view(now=100.0)  # last heartbeats at 100.0
    v.probe_sent_s, v.probe_epoch, v.probe_targets = 100.05, 1, frozenset({"a", "b"})
    v.beat("a", 100.1)  # answered the ping
    assert check_timeouts(100.3, v, CFG).action == Action.NONE  # still within probe_timeout_s (0.5 s)
    d = check_timeouts(100.6, v, CFG)
    assert d.action == Action.REPLACE_NODE and d.node == "b" and d.detector == "probe"


def test_probe_answered_by_everyone_is_nothing() -> None:
    v = view(now=100.0)
    v.probe_sent_s, v.probe_epoch, v.probe_targets = 100.0, 1, frozenset({"a", "b"})
    beat(v, 100.2)
    v.membership = v.membership.bump()  # a replacement happened meanwhile
    assert check_timeouts(100.6, v, CFG).action == Action.NONE


def test_first_exception_is_treated_as_a_fault_a_repeat_as_a_bug() -> None:
    v = view(spares=2)
    d = on_worker_exception(v, "a", "ValueError: bad shape", "worker 0 raised ValueError: bad shape")
    assert d.action == Action.REPLACE_NODE and d.detector == "exception"
    v.exceptions_seen.append("ValueError: bad shape")
    d = on_worker_exception(v, "b", "ValueError: bad shape", "worker 0 raised ValueError: bad shape")
    assert d.action == Action.FAIL_JOB and "bug in the training script" in d.reason
    assert on_worker_exception(v, "b", "RuntimeError: CUDA error", "...").action == Action.REPLACE_NODE


def test_a_collective_mismatch_abort_right_after_a_recovery_stops_the_job_not_a_node() -> None:
    v = view(spares=2)
    line = "what():  [enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 12 vs 8."
    cause = f"worker 1 (pid 7) exited with signal 6 ({line})"
    # the job's first epoch: no newcomer to blame, a node failure as any worker exit
    assert on_collective_abort(v, "a", line, cause).action == Action.REPLACE_NODE
    v.membership = Membership(3, 4, {"a": (0, 1), "b": (2, 3)}, committed=10)
    for step, want in ((10, Action.FAIL_JOB), (13, Action.FAIL_JOB), (14, Action.REPLACE_NODE)):
        for p in v.progress.values():
            p.step = step
        d = on_collective_abort(v, "a", line, cause)
        assert d.action == want, (step, d)
    for p in v.progress.values():
        p.step = 12
    d = on_collective_abort(v, "a", line, cause)
    assert d.reason.startswith("collective mismatch right after a recovery (epoch 3, step 12): worker 1")
    assert "12 vs 8" in d.reason and "program error" in d.reason and "\n" not in d.reason
    assert d.detector == "process-exit"


def test_a_rank_that_hangs_after_others_finished_is_blamed() -> None:
    v = view(now=100.0)
    v.done_ranks = {0, 1, 3}
    v.first_done_s = 101.0
    v.progress[2].state = "compute"
    assert check_timeouts(105.0, beat(v, 105.0), CFG).action == Action.NONE
    d = check_timeouts(107.0, beat(v, 107.0), CFG)
    assert d.action == Action.REPLACE_NODE and d.node == "b" and "rank 2" in d.reason


def test_a_rank_writing_its_last_checkpoint_is_excused_for_a_bounded_time() -> None:
    # Its steps are done and it waits for its last disk checkpoint (the worker bounds the
    # wait by the collective timeout): neither a culprit nor a stalled job until the bound.
    cfg = PolicyConfig(heartbeat_timeout_s=2.0, hang_timeout_s=5.0, checkpoint_wait_s=30.0)
    v = view(now=100.0)
    v.done_ranks = {0, 1, 3}
    v.first_done_s = 100.0
    v.progress[2].state = "checkpoint"
    assert check_timeouts(129.0, beat(v, 129.0), cfg).action == Action.NONE
    d = check_timeouts(131.0, beat(v, 131.0), cfg)
    assert d.action == Action.REPLACE_NODE and d.node == "b" and "state checkpoint" in d.reason
    # every rank writing: no "job stalled" within the bound either
    v = view(now=100.0)
    for p in v.progress.values():
        p.state = "checkpoint"
    assert check_timeouts(129.0, beat(v, 129.0), cfg).action == Action.NONE


def test_no_membership_yet_means_the_command_failed_not_the_node() -> None:
    v = view()
    v.membership = None
    d = on_node_failure(v, "a", "worker 0 exited with code 2", "process-exit", worker_fault=True)
    assert d.action == Action.FAIL_JOB and "before the job started" in d.reason


def test_a_node_lost_before_the_first_epoch_is_replaced_in_place() -> None:
    v = view()
    v.membership = None
    d = on_node_failure(v, "a", "node process exited with code -9", "process-exit")
    assert d.action == Action.REPLACE_NODE and d.membership is None and d.spare is not None
    assert "before the job started" in d.reason
    for s in v.spares():
        s.set_role(NodeRole.FENCED, "gone")
    d = on_node_failure(v, "a", "no heartbeat for 3.0s", "heartbeat")
    assert d.action == Action.FAIL_JOB and d.reason.startswith("no spare left")


def test_probe_judges_only_the_nodes_it_pinged() -> None:
    v = view(now=100.0)
    v.probe_sent_s, v.probe_epoch, v.probe_targets = 100.05, 1, frozenset({"a"})
    v.beat("a", 100.1)
    # b was not pinged (say it became active after the probe went out): never judged by it
    d = check_timeouts(100.6, v, CFG)
    assert d.action == Action.REFORM  # a answered, same epoch: transient


def test_transient_collective_failure_reforms_with_the_same_layout() -> None:
    v = view(now=100.0)
    v.probe_sent_s, v.probe_epoch, v.probe_targets = 100.05, 1, frozenset({"a", "b"})
    beat(v, 100.2)
    d = check_timeouts(100.6, v, CFG)
    assert d.action == Action.REFORM and d.membership == Membership(2, 4, {"a": (0, 1), "b": (2, 3)})
    v.membership = d.membership  # a replacement (or re-form) already happened: nothing more to do
    assert check_timeouts(100.6, v, CFG).action == Action.NONE


def test_start_up_silence_is_judged_with_the_longer_start_timeout() -> None:
    from resild.controller.policy import check_heartbeats

    v = view(now=100.0)
    v.membership = None
    v.beat("a", 90.0)  # silent 10 s: past the heartbeat timeout, within the start-up one
    for n in ("b", "s0"):
        v.beat(n, 100.0)
    assert check_heartbeats(100.0, v, CFG).action == Action.NONE
    d = check_heartbeats(106.0, v, CFG)
    assert d.action == Action.REPLACE_NODE and d.node == "a" and d.membership is None


def test_only_evidence_against_the_node_drains_it() -> None:
    """A worker's exception, exit or hang says nothing about the node: replaced, not drained."""
    from resild.controller.policy import drain_verdict

    v = view()
    assert on_node_failure(v, "a", "no heartbeat for 3.0s", "heartbeat").evidence
    assert on_node_failure(v, "a", "Xid 79", "gpu-probe").evidence
    assert on_node_failure(v, "a", "node process exited with code -9", "process-exit").evidence
    assert not on_node_failure(v, "a", "worker 0 exited with code 1", "process-exit", worker_fault=True).evidence
    assert not on_worker_exception(v, "a", "ValueError: x", "worker 0 raised ValueError: x").evidence
    hung = on_node_failure(v, "a", "hang: rank 0 made no progress", "hang")
    assert hung.action == Action.REPLACE_NODE and not hung.evidence
    # The verdict, on an injected clock: evidence drains; a first strike does not; a second
    # within the window does; one older than the window is forgiven.
    assert drain_verdict(1000.0, True, (), 3600.0)
    assert not drain_verdict(1000.0, False, (), 3600.0)
    assert drain_verdict(1000.0, False, (900.0,), 3600.0)
    assert not drain_verdict(5000.0, False, (900.0,), 3600.0)


# ---- abuse (policy.abuse_verdict, on_abuse), on a fake clock through the real Budget ----
ABUSE = AbuseLimits()


def _flood(budget: Budget, node: str, t0: float, seconds: float, per_s: int, size: int = 100) -> float:
    """`per_s` EVENTs a second from `node` for `seconds`; returns the clock at the end."""
    n = int(seconds * per_s)
    for i in range(n):
        budget.admit(node, "event", size, t0 + i / per_s)
    return t0 + seconds


def _verdict(budget: Budget, node: str, now: float, limits: AbuseLimits = ABUSE) -> Judgement:
    return abuse_verdict(now, node, budget.overages.get(node, ()), limits)


def test_a_node_that_stays_over_its_budget_is_abusive_and_named() -> None:
    budget = Budget({"event": Limits(messages=200, bytes=1 << 20)})
    now = _flood(budget, "a", 1000.0, 5.0, 1000)  # 800 dropped a second, for 5 s
    assert not _verdict(budget, "a", now).guilty  # 5 intervals of the 6: not yet
    now = _flood(budget, "a", now, 1.0, 1000)
    v = _verdict(budget, "a", now)
    assert v.guilty and v.reason.startswith("abuse: a stayed over its message budget: messages dropped in 6 intervals")
    assert "4800 messages" in v.reason
    assert not _verdict(budget, "b", now).guilty  # the budget, and the verdict, are per node
    assert not _verdict(budget, "a", now + 20.0).guilty  # it stopped: the window forgets it


def test_a_burst_or_a_node_at_its_budget_is_not_abusive() -> None:
    budget = Budget({"event": Limits(messages=200, bytes=1 << 20)})
    now = _flood(budget, "a", 1000.0, 0.9, 20000)  # 18000 at once, within one interval
    assert budget.dropped["a"] > 10000 and not _verdict(budget, "a", now).guilty
    now = _flood(budget, "b", 1000.0, 30.0, 200)  # just at its budget, for long
    assert "b" not in budget.dropped and not _verdict(budget, "b", now).guilty
    # Over the budget in most intervals but by a little (a few messages a second): loud, not abusive.
    now = _flood(budget, "c", 1000.0, 10.0, 210)
    assert budget.dropped["c"] > 0 and not _verdict(budget, "c", now).guilty
    # ...unless what it sends is large: the bytes count too.
    big = Budget({"event": Limits(messages=200, bytes=256 << 10)})
    now = _flood(big, "d", 1000.0, 10.0, 20, size=1 << 20)  # a 1 MB event 20 times a second
    assert _verdict(big, "d", now).guilty


def test_an_abusive_node_goes_to_a_spare_and_only_a_spare_saves_the_job() -> None:
    d = on_abuse(view(), "a", "abuse: a flooded")
    assert d.action == Action.REPLACE_NODE and d.node == "a" and d.spare == "s0" and d.evidence
    assert "abuse: a flooded" in d.reason and d.detector == "abuse"
    # No spare: fencing it would end the job, which is what the flood could not do. It stays.
    assert on_abuse(view(spares=0), "a", "abuse: a flooded").action == Action.NONE
    assert on_abuse(view(), "s0", "abuse: s0 flooded").action == Action.DROP_SPARE


def test_a_steady_job_is_checked_less_often_than_one_that_starts_recovers_or_probes() -> None:
    v = view()
    assert tick_interval_s(v, busy=False, tick_s=0.02, idle_tick_s=0.1) == 0.1
    assert tick_interval_s(v, busy=True, tick_s=0.02, idle_tick_s=0.1) == 0.02  # recovering, queued work
    v.probe_sent_s = 100.0  # a collective failed: the probe's answers are timed by the tick
    assert tick_interval_s(v, busy=False, tick_s=0.02, idle_tick_s=0.1) == 0.02
    v.probe_sent_s, v.membership = None, None  # starting
    assert tick_interval_s(v, busy=False, tick_s=0.02, idle_tick_s=0.1) == 0.02
    # An idle interval below the tick never makes it faster.
    assert tick_interval_s(view(), busy=False, tick_s=0.05, idle_tick_s=0.01) == 0.05


def test_an_admitted_spare_that_never_registers_is_dropped_after_its_deadline() -> None:
    """A joined node qualifies, then registers; one that never does would count toward
    --spare-target forever (refill.py) while it can never take ranks."""
    cfg = PolicyConfig(heartbeat_timeout_s=2.0, hang_timeout_s=5.0, admit_register_timeout_s=60.0)
    v = view(now=100.0, spares=0)
    v.add(NodeView("j0", NodeRole.SPARE, 2), now=100.0)  # admitted at 100, heard of nothing since
    assert v.nodes["j0"].admitted_s == 100.0
    assert check_timeouts(beat_active(v, 159.0), v, cfg).action == Action.NONE  # still qualifying
    d = check_timeouts(beat_active(v, 161.0), v, cfg)
    assert (d.action, d.node) == (Action.DROP_SPARE, "j0") and "never registered" in d.reason, d
    # registered in time: nothing, however long it waits
    v.nodes["j0"].registered = True
    assert check_timeouts(beat_active(v, 500.0), v, cfg).action == Action.NONE


def test_a_start_up_spare_still_starting_is_not_the_admission_checks() -> None:
    cfg = PolicyConfig(heartbeat_timeout_s=2.0, hang_timeout_s=5.0, admit_register_timeout_s=60.0)
    v = view(now=100.0, spares=0)
    v.nodes["s9"] = NodeView("s9", NodeRole.SPARE, 2)  # started with the job, not registered yet
    v._hb_order["s9"] = None
    assert check_timeouts(beat_active(v, 1000.0), v, cfg).action == Action.NONE


def beat_active(v: ClusterView, now: float) -> float:
    """Every registered node heard at `now` (the admitted one stays silent). -> now"""
    for n, node in v.nodes.items():
        if node.registered:
            v.beat(n, now)
            for r, p in v.progress.items():
                v.progress[r] = RankProgress(step=p.step + 1, epoch=p.epoch, state="commit", t_s=now)
    v.last_commit_s = now
    return now


# ---- shrink and grow (--min-replicas) -------------------------------------------------------


def shrinkable(spares: int = 0, min_replicas: int = 2, unit: int = 1) -> ClusterView:
    """Two active nodes of 2 ranks; `unit` ranks per replica group, as rank 0 said."""
    v = view(spares=spares)
    v.full_world, v.min_replicas, v.replica_ranks = 4, min_replicas, unit
    return v


def test_no_spare_and_no_min_replicas_still_stops_the_job() -> None:
    assert on_node_failure(shrinkable(min_replicas=0), "a", "Xid 79", "gpu-probe").action == Action.FAIL_JOB


def test_no_spare_shrinks_the_job_renumbering_the_survivors() -> None:
    d = on_node_failure(shrinkable(), "a", "exited", "process-exit", worker_fault=True)
    assert d.action == Action.SHRINK and d.node == "a" and d.spare is None
    assert d.membership == Membership(2, 2, {"b": (0, 1)})
    assert d.reason == "a failed (exited); no spare left: 2 replicas train on"
    assert d.evidence is False  # a worker's fault: suspect, as with a spare


def test_a_shrink_counts_replicas_in_the_unit_rank_0_said() -> None:
    # HSDP with replica groups of 2 ranks: losing a 2-rank node leaves one group
    assert on_node_failure(shrinkable(min_replicas=1, unit=2), "b", "x", "heartbeat").action == Action.SHRINK
    assert on_node_failure(shrinkable(min_replicas=2, unit=2), "b", "x", "heartbeat").action == Action.FAIL_JOB
    # a node holding part of a replica group (groups of 4 ranks over two 2-rank nodes): never
    assert on_node_failure(shrinkable(min_replicas=1, unit=4), "b", "x", "heartbeat").action == Action.FAIL_JOB
    # the unit not said (yet): never
    assert on_node_failure(shrinkable(unit=0), "b", "x", "heartbeat").action == Action.FAIL_JOB


def test_below_the_floor_the_job_stops() -> None:
    assert on_node_failure(shrinkable(min_replicas=3), "a", "x", "heartbeat").action == Action.FAIL_JOB


def test_a_spare_is_used_before_any_shrink() -> None:
    assert on_node_failure(shrinkable(spares=1), "a", "x", "heartbeat").action == Action.REPLACE_NODE


def _shrunk(spare_ready: bool = True, nproc: int = 2) -> ClusterView:
    v = shrinkable()
    v.nodes["a"].set_role(NodeRole.FENCED)
    v.membership = Membership.initial(["a", "b"], 2).shrink("a")
    ready = nproc if spare_ready else 0
    v.nodes["j"] = NodeView("j", NodeRole.SPARE, nproc, registered=spare_ready, workers_ready=ready)
    return v


def test_a_shrunk_job_grows_back_with_a_warm_spare_once_its_recovery_is_over() -> None:
    d = check_grow(_shrunk(), busy=False)
    assert d.action == Action.GROW and d.spare == "j"
    assert d.membership == Membership(3, 4, {"b": (0, 1), "j": (2, 3)})
    assert d.reason == "j joins: 4 of 4 replicas"
    assert check_grow(_shrunk(), busy=True).action == Action.NONE  # a recovery still under way


def test_no_grow_without_a_ready_spare_that_fits_or_at_full_width() -> None:
    assert check_grow(_shrunk(spare_ready=False), busy=False).action == Action.NONE
    assert check_grow(_shrunk(nproc=4), busy=False).action == Action.NONE  # beyond the full width
    full = shrinkable(spares=1)
    assert check_grow(full, busy=False).action == Action.NONE  # not shrunk
    off = _shrunk()
    off.min_replicas = 0
    assert check_grow(off, busy=False).action == Action.NONE


def three_nodes(min_replicas: int = 2, committed: int = 0) -> ClusterView:
    """Three active nodes of 2 ranks (a: 0-1, b: 2-3, c: 4-5), no spare, data parallel."""
    v = view(spares=0)
    v.nodes["c"] = NodeView("c", NodeRole.ACTIVE, 2, registered=True, last_heartbeat_s=100.0, workers_ready=2)
    v.membership = Membership.initial(["a", "b", "c"], 2).with_committed(committed)
    v.full_world, v.min_replicas, v.replica_ranks = 6, min_replicas, 1
    return v


def test_a_shrink_closes_the_gap_keeping_the_survivors_order_and_the_floor() -> None:
    d = on_node_failure(three_nodes(committed=30), "b", "Xid 79", "gpu-probe")
    assert d.action == Action.SHRINK and (d.node, d.spare, d.detector) == ("b", None, "gpu-probe")
    # c's ranks 4-5 become 2-3; a keeps 0-1; the epoch moves on and keeps the committed floor
    assert d.membership == Membership(2, 4, {"a": (0, 1), "c": (2, 3)}, committed=30)
    assert d.reason == "b failed (Xid 79); no spare left: 4 replicas train on"
    assert d.evidence is True  # the node's own failure: drained, as with a spare


def test_the_floor_is_inclusive_and_counted_in_replicas_left() -> None:
    # 6 ranks, a 2-rank node lost: 4 replicas left
    assert on_node_failure(three_nodes(min_replicas=4), "a", "x", "heartbeat").action == Action.SHRINK
    d = on_node_failure(three_nodes(min_replicas=5), "a", "x", "heartbeat")
    assert d.action == Action.FAIL_JOB and d.membership is None
    assert d.reason == "no spare left: a failed (x)"


def test_a_hang_or_a_heartbeat_loss_shrinks_through_the_timeout_checks() -> None:
    v = shrinkable()
    v.beat("b", 100.5)
    d = check_timeouts(102.2, v, CFG)  # a silent 2.2 s
    assert (d.action, d.node, d.detector, d.evidence) == (Action.SHRINK, "a", "heartbeat", True)
    assert d.membership == Membership(2, 2, {"b": (0, 1)})
    hung = shrinkable()
    for r in (0, 1, 3):
        hung.progress[r].state = "wait"
    d = check_timeouts(106.0, beat(hung, 106.0), CFG)
    assert (d.action, d.node, d.detector, d.evidence) == (Action.SHRINK, "b", "hang", False)
    assert d.membership == Membership(2, 2, {"a": (0, 1)})


def test_a_node_lost_before_the_first_epoch_never_shrinks_the_job() -> None:
    v = shrinkable(min_replicas=1)
    v.membership = None
    d = on_node_failure(v, "a", "no heartbeat", "heartbeat")
    assert d.action == Action.FAIL_JOB and d.membership is None


def test_a_registered_cold_spare_replaces_and_only_an_unregistered_one_lets_the_job_shrink() -> None:
    cold = shrinkable(spares=1)
    cold.nodes["s0"].workers_ready = 0  # registered, workers still warming up: it can take the ranks
    d = on_node_failure(cold, "a", "x", "heartbeat")
    assert (d.action, d.spare) == (Action.REPLACE_NODE, "s0")
    assert d.membership == Membership(2, 4, {"s0": (0, 1), "b": (2, 3)})
    starting = shrinkable(spares=1)
    starting.nodes["s0"].registered = False  # admitted, still qualifying: no ranks for it yet
    assert on_node_failure(starting, "a", "x", "heartbeat").action == Action.SHRINK


def test_grow_needs_a_registered_spare_with_every_worker_ready() -> None:
    half_ready = _shrunk()
    half_ready.nodes["j"].workers_ready = 1
    assert check_grow(half_ready, busy=False).action == Action.NONE
    silent = _shrunk()
    silent.nodes["j"].registered = False  # its workers ready, its node process never registered
    assert check_grow(silent, busy=False).action == Action.NONE
    no_unit = _shrunk()
    no_unit.replica_ranks = 0  # a new leader before rank 0 said it
    assert check_grow(no_unit, busy=False).action == Action.NONE
    not_started = _shrunk()
    not_started.membership = None
    assert check_grow(not_started, busy=False).action == Action.NONE


def test_grow_takes_the_first_spare_that_fits_whole_replica_groups() -> None:
    v = _shrunk(nproc=4)  # "j": 4 ranks would make 6 of 4
    v.nodes["k"] = NodeView("k", NodeRole.SPARE, 2, registered=True, workers_ready=2)
    d = check_grow(v, busy=False)
    assert (d.action, d.spare, d.node) == (Action.GROW, "k", None)
    assert d.membership == Membership(3, 4, {"b": (0, 1), "k": (2, 3)})
    hsdp = _shrunk(nproc=1)  # a 1-rank spare: half a replica group of 2
    hsdp.replica_ranks, hsdp.min_replicas = 2, 1
    assert check_grow(hsdp, busy=False).action == Action.NONE
    hsdp.nodes["k"] = NodeView("k", NodeRole.SPARE, 2, registered=True, workers_ready=2)
    d = check_grow(hsdp, busy=False)
    assert d.spare == "k" and d.reason == "k joins: 2 of 2 replicas"


def test_a_partial_grow_keeps_the_floor_and_grows_again_later() -> None:
    v = three_nodes(min_replicas=1, committed=0)
    for lost in ("a", "b"):
        v.nodes[lost].set_role(NodeRole.FENCED)
    assert v.membership is not None
    v.membership = v.membership.shrink("a").shrink("b").with_committed(55)  # epoch 3: c alone
    v.nodes["j"] = NodeView("j", NodeRole.SPARE, 2, registered=True, workers_ready=2)
    v.nodes["k"] = NodeView("k", NodeRole.SPARE, 2, registered=True, workers_ready=2)
    d = check_grow(v, busy=False)
    assert d.action == Action.GROW and d.spare == "j" and d.reason == "j joins: 4 of 6 replicas"
    assert d.membership == Membership(4, 4, {"c": (0, 1), "j": (2, 3)}, committed=55)
    # the controller applies it; still 2 ranks short: k next, to the full width, then nothing
    v.nodes["j"].set_role(NodeRole.ACTIVE)
    v.membership = d.membership
    d = check_grow(v, busy=False)
    assert d.spare == "k" and d.membership == Membership(5, 6, {"c": (0, 1), "j": (2, 3), "k": (4, 5)}, committed=55)
    v.nodes["k"].set_role(NodeRole.ACTIVE)
    v.membership = d.membership
    v.nodes["l"] = NodeView("l", NodeRole.SPARE, 2, registered=True, workers_ready=2)
    assert check_grow(v, busy=False).action == Action.NONE  # at full width: l stays a spare


def test_an_abusive_node_with_no_spare_left_stays_in_and_never_shrinks_the_job() -> None:
    """The job does not pay for one node's flood: no stop, and no shrink either."""
    assert on_abuse(shrinkable(), "b", "over its message budget").action == Action.NONE
    assert on_abuse(shrinkable(spares=1), "b", "over its message budget").action == Action.REPLACE_NODE


def test_a_straggler_is_replaced_only_when_asked_when_it_pays_and_when_a_spare_is_free() -> None:
    from resild.controller.policy import on_straggler
    from resild.controller.stragglers import Straggler

    slow = Straggler("b", 0.5, 0.15, 0.10, 20)
    d, cost_s = on_straggler(view(), slow, True, steps_left=1000, recovery_s=5.0)
    assert d.action == Action.REPLACE_NODE and d.node == "b" and d.spare == "s0" and d.detector == "straggler"
    assert not d.evidence and cost_s == pytest.approx(50.0)  # slowness alone: suspected, not drained
    assert "50% slower" in d.reason
    d, _ = on_straggler(view(), slow, False, steps_left=1000, recovery_s=5.0)
    assert d.action == Action.NONE and "reported only" in d.reason
    d, _ = on_straggler(view(), slow, True, steps_left=40, recovery_s=5.0)
    assert d.action == Action.NONE and "less than a recovery" in d.reason
    d, _ = on_straggler(view(spares=0), slow, True, steps_left=1000, recovery_s=5.0)
    assert d.action == Action.NONE and "no spare" in d.reason


def test_a_straggler_with_hardware_evidence_is_replaced_and_drained_with_it() -> None:
    """Its daemon's degraded reasons (clocks slowed, a PCIe link below its maximum) are the
    evidence: replaced, it is drained (evidence=True) and the reason says why; a healthy or
    merely failed-to-say node gives none."""
    from resild.controller.policy import on_straggler, straggler_evidence
    from resild.controller.stragglers import Straggler

    v = view()
    slow = Straggler("b", 0.5, 0.15, 0.10, 20)
    assert straggler_evidence(v, "b") == []
    v.nodes["b"].health, v.nodes["b"].health_reasons = "degraded", ("PCIe link degraded: x8 of x16 lanes",)
    assert straggler_evidence(v, "b") == ["PCIe link degraded: x8 of x16 lanes"]
    d, _ = on_straggler(v, slow, True, steps_left=1000, recovery_s=5.0)
    assert d.action == Action.REPLACE_NODE and d.evidence
    assert "with hardware evidence: PCIe link degraded: x8 of x16 lanes" in d.reason
    d, _ = on_straggler(view(spares=0), slow, True, steps_left=1000, recovery_s=5.0)
    assert "hardware evidence" not in d.reason  # another view: b healthy there
    v.nodes["b"].health = "unknown"  # cannot tell: not evidence
    assert straggler_evidence(v, "b") == []
