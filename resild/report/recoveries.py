"""The recoveries of a job, from its event stream: one analysis for every reader.

`recoveries(events)` is used by resil-run's end-of-run table and live status line
(`launcher.run.status`) and by `resild report` (`resild.report.goodput`), so the three
always agree on what failed, when the recovery started and ended, and what it cost.

A recovery starts at a ``failure_detected`` (a node lost: replaced by a spare, or the
job stops) or at a ``reform`` (a transient collective failure: every node alive, same
layout, new epoch). Rules, where the two analyzers that came before this module differed:

- A ``reform`` is a recovery: the group is torn down and re-formed and the steps since
  the last commit are computed again. (The end-of-run table used to list only
  ``failure_detected``, so a job with a transient failure printed "no failures" while its
  goodput showed the lost time.)
- The fault's start is the injected fault when there is one (the latest on that node not
  matched before; a re-form takes the latest on any node), else the first
  ``collective_failed`` report since the previous recovery ended, else the detection
  itself. (The table used the detection when nothing was injected, so its recovery time
  left out the time the failure took to be noticed, which the collective failure shows.)
- Steps redone come from rank 0's ``resumed`` of *this* recovery's epoch. (The table took
  the first ``resumed`` of this epoch or any later one: a fault during the recovery then
  lent the next recovery's resume to both, and counted its redone steps twice.)
- A node replaced before training started (``spare_assigned`` with ``before_start``) is
  its own kind: its time is part of start-up, not a recovery phase. (The report called
  it "spare lost"; the table measured it like any recovery.)
- Phases (detection, fence, re-form, replay, first step) are made monotone and clipped
  at the next recovery's start, so overlapping recoveries never count a second twice.

Instants are on the log's clock (``t_log`` when a worker stamped its own clock, else
``t_mono``); durations a worker measured (``seconds``) are its own. Events are expected
in log order; records that are malformed or of unknown events are skipped, never fatal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from resild.events.schema import (
    CollectiveFailed,
    Detector,
    FailureDetected,
    FaultInjected,
    FullStrengthStep,
    GroupReformed,
    JobResized,
    MembershipEvent,
    NodeFenced,
    NodeRegistered,
    Record,
    Reform,
    Resumed,
    RolledBack,
    SpareAssigned,
    StateReplayed,
    parse,
)

PHASES = ("detection", "fence", "re-form", "replay", "first step")

NODE_FAILURE = "node failure"  # an active node lost: a spare takes over, or the job stops
SPARE_LOST = "spare lost"  # a hot spare failed: training went on
REFORM = "re-form"  # transient: no node lost, the same layout re-forms in a new epoch
BEFORE_START = "before start"  # replaced before the first epoch ran: part of start-up

RECOVERED = "recovered"  # back at full strength
NOT_RECOVERED = "not recovered"  # never back at full strength (the job stopped)
TRAINING_WENT_ON = "training went on"  # a spare lost: nothing to recover


@dataclass
class Recovery:
    index: int  # 1-based, in detection order
    kind: str  # NODE_FAILURE, SPARE_LOST, REFORM, BEFORE_START
    node: str | None  # the failed node (None for a re-form)
    rank: int | None  # the rank whose failed collective was reported first, when that set the fault time
    cause: str
    detector: str
    fault: str | None  # the injected fault's spec, when injected
    fault_time_from: str  # "injected", "collective failure" or "detection" (start unknown)
    # Instants on the log's clock; None where the recovery never got there.
    t_fault: float
    t_detected: float
    t_fenced: float | None = None  # node_fenced (a re-form fences nothing)
    t_decided: float | None = None  # spare_assigned or reform: the new epoch decided
    t_announced: float | None = None  # the new epoch's membership sent
    t_reformed: float | None = None  # rank 0's new group formed (estimated when not reported)
    t_replayed: float | None = None  # the last rank behind has the state
    t_first_step: float | None = None  # the first step committed at full strength
    epoch: int | None = None  # the epoch this recovery formed
    spares_left: int | None = None
    committed_step: int | None = None  # the newest committed step at detection
    resumed_step: int | None = None  # the step training restarted from
    steps_redone: int | None = None  # committed before, computed again after; None: not resumed
    recovered_from: str | None = None  # a RestoreSource value (resild.events.schema)
    bytes_replayed: int = 0
    replay_s: float | None = None  # the slowest state transfer (a receiver's own seconds)
    phases: dict[str, float] = field(default_factory=dict)  # PHASES -> seconds; {} when training never stopped
    overlapped: bool = False  # the next recovery started before this one finished
    outcome: str = NOT_RECOVERED

    @property
    def detect_s(self) -> float | None:
        """Fault -> detection; None when the fault's start is not known."""
        return None if self.fault_time_from == "detection" else self.t_detected - self.t_fault

    @property
    def recovery_s(self) -> float | None:
        """Fault -> the first full-strength step; None when not back at full strength."""
        return None if self.t_first_step is None else self.t_first_step - self.t_fault

    @property
    def stopped_training(self) -> bool:
        """Training stopped for it (its phases are time lost), unlike a lost spare or a
        replacement before the start."""
        return self.kind in (NODE_FAILURE, REFORM)


E = TypeVar("E", bound=Record)


def _of(evs: Iterable[Record], cls: type[E]) -> list[E]:
    return [e for e in evs if isinstance(e, cls)]


def _first(evs: Iterable[Record], cls: type[E], after: float = float("-inf"), **match: Any) -> E | None:
    for e in evs:
        if isinstance(e, cls) and e.t >= after and all(getattr(e, k) == v for k, v in match.items()):
            return e
    return None


def initial_layout(evs: Sequence[Record]) -> set[str]:
    """The first epoch's training nodes (or, without one, the nodes registered active)."""
    m1 = _first(evs, MembershipEvent, epoch=1)
    if m1 is not None and m1.nodes:
        return set(m1.nodes)
    return {e.node for e in _of(evs, NodeRegistered) if e.role == "active" and e.node is not None}


def recoveries(events: Iterable[Mapping[str, Any]]) -> list[Recovery]:
    """Every recovery of one job's events (in log order), in detection order."""
    ev = [r for r in (parse(e) for e in events) if r is not None]
    layout = initial_layout(ev)
    faults = _of(ev, FaultInjected)
    used_faults: set[int] = set()  # indices into `faults`
    out: list[Recovery] = []
    timed: list[tuple[Recovery, list[float]]] = []
    prev_end = float("-inf")
    for e in ev:
        if isinstance(e, MembershipEvent):
            layout = set(e.nodes)
            continue
        if not isinstance(e, (FailureDetected, Reform)):
            continue
        t_det = e.t
        node = e.node if isinstance(e, FailureDetected) else None
        # The fault that led here: the latest injection (on that node) not matched yet.
        fault_i = None
        for i, x in enumerate(faults):
            if i not in used_faults and x.t <= t_det and (node is None or x.node == node):
                fault_i = i
        fault = faults[fault_i] if fault_i is not None else None
        if fault_i is not None:
            used_faults.add(fault_i)
        coll = next((x for x in _of(ev, CollectiveFailed) if prev_end <= x.t <= t_det), None)
        if fault is not None:
            t_fault, src = fault.t, "injected"
        elif coll is not None:
            t_fault, src = coll.t, "collective failure"
        else:
            t_fault, src = t_det, "detection"
        assigned: SpareAssigned | None = None
        decided: SpareAssigned | JobResized | None = None  # the new epoch: a spare's, or a shrink's
        t_fenced: float | None = None
        t_decided: float | None = None
        if isinstance(e, Reform):
            kind, ep, cause, detector = REFORM, e.epoch, e.reason, Detector.PROBE.value
            t_fence, t_decided = t_det, t_det
        else:
            # This failure's decision comes before the same node's next failure (a spare lost,
            # re-admitted, lost again: the second loss's epoch is not the first's).
            again = next((x.t for x in _of(ev, FailureDetected) if x.t > t_det and x.node == node), float("inf"))
            mine = [x for x in ev if x.t < again]
            assigned = _first(mine, SpareAssigned, after=t_det, failed=node)
            # no spare left: the job may have shrunk instead (--min-replicas), into its own epoch
            shrunk = _first(mine, JobResized, after=t_det, node=node, how="shrink") if assigned is None else None
            if assigned is not None and assigned.before_start:
                kind = BEFORE_START
            else:
                kind = NODE_FAILURE if node in layout else SPARE_LOST
            decided = assigned or shrunk
            ep, cause, detector = (decided.epoch if decided else None), e.cause, e.detector
            fenced = _first(ev, NodeFenced, after=t_det, node=node)
            t_fenced = fenced.t if fenced else None
            t_fence = t_fenced if t_fenced is not None else t_det
            t_decided = decided.t if decided else None
        r = Recovery(
            index=len(out) + 1,
            kind=kind,
            node=node,
            rank=coll.rank if src == "collective failure" and coll is not None else None,
            cause=cause,
            detector=detector,
            fault=fault.spec if fault else None,
            fault_time_from=src,
            t_fault=t_fault,
            t_detected=t_det,
            t_fenced=t_fenced,
            t_decided=t_decided,
            epoch=ep,
            spares_left=decided.spares_left if decided else None,
            committed_step=e.committed_step if isinstance(e, FailureDetected) else None,
        )
        out.append(r)
        if kind == SPARE_LOST:
            r.outcome = TRAINING_WENT_ON  # training never stopped: no phases
            continue
        bounds = [t_fault, t_det, t_fence]
        if ep is not None:
            later = [x for x in ev if x.t >= t_det]
            announced = _first(later, MembershipEvent, epoch=ep)
            r.t_announced = announced.t if announced else None
            full = next((x for x in _of(later, FullStrengthStep) if (x.epoch or 0) >= ep), None)
            resumed = _first(later, Resumed, epoch=ep)
            reformed = _first(later, GroupReformed, epoch=ep)
            replayed = [x for x in _of(later, StateReplayed) if x.epoch == ep]
            r.bytes_replayed = sum(x.bytes for x in replayed)
            r.replay_s = max((x.seconds for x in replayed if x.seconds is not None), default=None)
            if full is not None:
                t_full = full.t
                t_res = resumed.t if resumed else t_full
                # Replay ends when the last receiver has the state; it starts when rank 0's new
                # group was formed (its recovery seconds minus its formation seconds, before t_res).
                t_replayed = max([t_res] + [x.t for x in replayed])
                if (
                    resumed is not None
                    and reformed is not None
                    and resumed.seconds is not None
                    and reformed.seconds is not None
                ):
                    t_formed = t_res - max(0.0, resumed.seconds - reformed.seconds)
                else:
                    t_formed = t_replayed - max((x.seconds or 0.0 for x in replayed), default=0.0)
                bounds += [t_formed, t_replayed, t_full]
                r.t_reformed, r.t_replayed, r.t_first_step = t_formed, t_replayed, t_full
                r.outcome = RECOVERED
                if resumed is not None and resumed.step is not None:
                    r.resumed_step = resumed.step
                    r.recovered_from = resumed.source
                    if r.committed_step is not None:
                        # a rollback redoes from the newest step any rank held, which the
                        # controller may not have heard of yet (commits are reported in batches)
                        back = _first(later, RolledBack, epoch=ep)
                        newest = max(r.committed_step, back.newest if back and back.newest is not None else 0)
                        r.steps_redone = max(0, newest - resumed.step)
            else:
                bounds += [t_fence] * 3  # never back to full strength: the rest is the job stopping
        else:
            bounds += [t_fence] * 3  # no spare: the job stopped
        if kind == BEFORE_START:
            continue  # start-up time, not a recovery's: no phases
        timed.append((r, bounds))
        prev_end = bounds[-1]
    # Boundaries are made monotone and clipped at the next recovery's start, so the phases
    # of overlapping recoveries (a fault during a recovery) never count the same second twice.
    for i, (r, b) in enumerate(timed):
        nxt = timed[i + 1][0].t_fault if i + 1 < len(timed) else float("inf")
        r.overlapped = nxt < b[-1]
        cap = min(b[-1], nxt)
        mono: list[float] = []
        for bt in b:
            mono.append(min(max(bt, mono[-1] if mono else bt), cap))
        r.phases = {p: mono[k + 1] - mono[k] for k, p in enumerate(PHASES)}
    return out
