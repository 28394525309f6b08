"""Where a job's time went: its event log → a goodput breakdown (pure; no I/O but `load_events`).

The job's wall time (job_started → job_finished/job_failed, on the controller's clock) is
split into parts that add up to it:

- start-up: job_started → the first committed step (processes, torch import, model build,
  first group formation, first step);
- per failure: detection (fault → failure_detected), fence (→ node_fenced), re-form
  (→ the new group formed and the committed step agreed: the announcement, abandoning the
  collective in flight, the new gloo/NCCL group), replay (state sent to the ranks behind),
  first step (→ the first step committed by the whole re-formed group);
- redone steps: steps committed before a failure and computed again after it;
- productive: committed steps x the median step time;
- idle: the rest of the training window (steps slower than the median, the step in flight
  when a fault hit, waits);
- shutdown: the last committed step → the end (final save, processes exiting).

A fault's start is known when it was injected (`fault_injected`); otherwise it is the first
`collective_failed` report of the epoch, or, failing that, the detection itself (detection
then counts as 0 and the lost time shows up as idle). Worker events carry the worker's clock
in ``t_mono`` and the log's in ``t_log``: durations come from the worker, instants from the log.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

from resild.events.schema import EventName, Progress, as_float
from resild.report.checkpoints import CheckpointCounts, checkpoint_counts
from resild.report.recoveries import BEFORE_START, NODE_FAILURE, PHASES, REFORM, SPARE_LOST, recoveries


class EventFileError(ValueError):
    """The event file cannot be read as a resild event log (message fit for one line)."""


@dataclass
class FailureBreakdown:
    """One recovery (resild.report.recoveries) as `resild report` and resil-run's end-of-run
    table and --json summary show it."""

    index: int
    kind: str  # "node failure", "spare lost", "re-form" (transient; no node lost), "before start"
    node: str | None
    cause: str
    detector: str
    fault: str | None  # the injected fault's spec, when injected
    fault_time_from: str  # "injected", "collective failure" or "detection" (start unknown)
    t_fault: float  # seconds since job start
    phases: dict[str, float] = field(default_factory=dict)  # PHASES → seconds (clipped: no overlap)
    recovery_s: float | None = None  # fault → full strength; None: not recovered
    committed_step: int | None = None
    resumed_step: int | None = None
    steps_redone: int = 0
    redone_s: float = 0.0
    bytes_replayed: int = 0
    spares_left: int | None = None
    epoch: int | None = None
    overlapped: bool = False  # a later failure hit before this recovery finished
    # resil-run's summary only (RESIL_RUN_ONLY: not in the report's JSON)
    detect_s: float | None = None  # fault → detection; None when the fault's start is not known
    replay_s: float | None = None  # the slowest state transfer (a receiver's own seconds)
    recovered_from: str | None = None  # replica | snapshot | checkpoint

    @property
    def steps_lost(self) -> int | None:
        """The steps redone, None where not known (training never resumed, or no committed
        step at detection): what resil-run shows ('-'), where the report counts 0."""
        return None if self.resumed_step is None or self.committed_step is None else self.steps_redone

    def summary(self) -> dict[str, Any]:
        """A row of resil-run's --json summary (its keys, in its order)."""
        return {
            "node": self.node,
            "cause": self.cause,
            "detector": self.detector,
            "fault": self.fault,
            "detect_s": self.detect_s,
            "recovery_s": self.recovery_s,
            "steps_lost": self.steps_lost,  # the older name of steps_redone
            "bytes_replayed": self.bytes_replayed,
            "replay_s": self.replay_s,
            "steps_redone": self.steps_lost,
            "recovered_from": self.recovered_from,
        }


RESIL_RUN_ONLY = ("detect_s", "replay_s", "recovered_from")  # FailureBreakdown's fields the report leaves out


@dataclass
class Breakdown:
    outcome: str  # finished / failed / incomplete (no end event: still running or killed)
    reason: str
    nodes: int
    active_nodes: int
    initial_spares: int
    wall_s: float
    startup_s: float
    productive_s: float
    recovery_s: float
    redone_s: float
    idle_s: float
    shutdown_s: float
    phase_totals: dict[str, float]
    steps: int  # steps committed after the first one (each counted once)
    step_s: float | None  # median step time
    goodput: float | None  # productive / wall
    training_goodput: float | None  # steps x median step / (first → last commit), as resil-run prints
    gpu_goodput: float | None  # productive GPU-time / every allocated GPU's time (spares idle too)
    failures: list[FailureBreakdown]
    step_line: list[tuple[float, int]]  # (seconds since start, committed step)
    spares_line: list[tuple[float, int]]  # (seconds since start, spares left)
    # (seconds since start, cold spares asked of the queue and not joined yet: --spare-target)
    queued_line: list[tuple[float, int]] = field(default_factory=list)
    jobs_in_file: int = 1
    job_index: int = 1
    checkpoints: dict[str, Any] | None = None  # resild.report.checkpoints, when the job wrote any
    unvouched: str | None = None  # why resild cannot vouch for the job's state (unvouched()); None: it can
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # stragglers(): found, replaced or reported

    def parts(self) -> list[tuple[str, float]]:
        return [
            ("productive steps", self.productive_s),
            ("start-up", self.startup_s),
            ("recovery", self.recovery_s),
            ("redone steps", self.redone_s),
            ("idle / slow steps", self.idle_s),
            ("shutdown", self.shutdown_s),
        ]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for f in d["failures"]:
            for k in RESIL_RUN_ONLY:
                del f[k]
        d["step_line"] = [[round(t, 4), s] for t, s in self.step_line]
        d["spares_line"] = [[round(t, 4), s] for t, s in self.spares_line]
        d["queued_line"] = [[round(t, 4), s] for t, s in self.queued_line]
        return d


# ---- reading ----------------------------------------------------------------------------
# Bounds on what `resild report` reads: a real log's lines are a few hundred bytes (the
# controller caps a node's events; see resild.controller.budget) and a week-long job's file
# a few GB at most; /dev/zero or a stray binary must end in an error, not in a hang.
MAX_LINE_BYTES = 1 << 20
MAX_FILE_BYTES = 8 << 30


def _no_non_finite(name: str) -> Any:
    # resild's wire refuses NaN and Infinity, so a file holding them was edited or is
    # foreign. Refused, not skipped: a total computed from what is left would be wrong
    # ("total 0.000") without saying so; the error names the line to fix.
    raise ValueError(f"non-finite number {name}")


MAX_NUMBER = 1e15  # past any step count or clock reading resild writes (seconds since boot or 1970)


def _number(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return abs(v) <= MAX_NUMBER if isinstance(v, int) else math.isfinite(v) and abs(v) <= MAX_NUMBER


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_NUMBER


def _text(v: Any) -> bool:
    return isinstance(v, str)


def _layout(v: Any) -> bool:
    return isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(r, list) and all(_count(x) for x in r) for k, r in v.items()
    )


def _names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# The fields the report reads, by name in any event: a value of another type (None aside)
# is a file resild did not write, refused naming the line and the field.
_FIELDS: dict[str, tuple[Any, str]] = {
    "t_mono": (_number, "a number"),
    "t_log": (_number, "a number"),
    "train_s": (_number, "a number"),
    "step_s": (_number, "a number"),
    "step": (_count, "a whole number >= 0"),
    "final_step": (_count, "a whole number >= 0"),
    "count": (_count, "a whole number >= 0"),
    "bytes": (_count, "a whole number >= 0"),
    "committed_step": (_count, "a whole number >= 0"),
    "epoch": (_count, "a whole number >= 0"),
    "world_size": (_count, "a whole number >= 0"),
    "spares_left": (_count, "a whole number >= 0"),
    "node": (_text, "a string"),
    "spare": (_text, "a string"),
    "how": (_text, "a string"),
    "role": (_text, "a string"),
    "source": (_text, "a string"),
    "reason": (_text, "a string"),
    "unvouched": (_text, "a string"),
    "layout": (_layout, "a map of node to ranks"),
    "nodes": (_names, "a list of node names"),
}


def _bad_field(rec: dict[str, Any]) -> str | None:
    for name, v in rec.items():
        check = _FIELDS.get(name)
        if check is not None and v is not None and not check[0](v):
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:40] + "..."
            return f"field {name!r} must be {check[1]}, not {shown}"
    return None


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines event file. Raises EventFileError with a one-line reason."""
    p = Path(path)
    try:
        raw = _read_lines(p)
    except FileNotFoundError:
        raise EventFileError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise EventFileError(f"{p}: is a directory, not an event file") from None
    except OSError as e:
        raise EventFileError(f"{p}: {e.strerror}") from None
    out: list[dict[str, Any]] = []
    for n, (bline, complete) in enumerate(raw, 1):
        try:
            line = bline.decode("utf-8")
        except UnicodeDecodeError:
            raise EventFileError(f"{p}: not a text file (expected JSON lines from resil-run --events)") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line, parse_constant=_no_non_finite)
        except json.JSONDecodeError as e:
            if n == len(raw) and not complete:
                break  # the last line of a log still being written
            raise EventFileError(
                f"{p}:{n}: not JSON ({e.msg}); expected one event per line as written by resil-run --events"
            ) from None
        except RecursionError:
            raise EventFileError(f"{p}:{n}: JSON nested too deeply to be a resild event") from None
        except ValueError as e:  # _no_non_finite
            raise EventFileError(f"{p}:{n}: {e} (resild never writes one)") from None
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("event"), str)
            or not isinstance(rec.get("t_mono"), (int, float))
        ):
            raise EventFileError(f'{p}:{n}: not a resild event (needs "event" and "t_mono")')
        if (why := _bad_field(rec)) is not None:
            raise EventFileError(f"{p}:{n}: {why} (resild never writes one)")
        out.append(rec)
    if not out:
        raise EventFileError(f"{p}: empty (no events)")
    return out


def _read_lines(p: Path) -> list[tuple[bytes, bool]]:
    """The file's lines (and whether each ended with a newline), within the bounds above."""
    out: list[tuple[bytes, bool]] = []
    total = 0
    with open(p, "rb") as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            total += len(line)
            complete = line.endswith(b"\n")
            if len(line) > MAX_LINE_BYTES and not complete:
                raise EventFileError(f"{p}:{len(out) + 1}: a line over {MAX_LINE_BYTES >> 20} MB: not an event file")
            if total > MAX_FILE_BYTES:
                raise EventFileError(f"{p}: over {MAX_FILE_BYTES >> 30} GB: not read")
            out.append((line.rstrip(b"\r\n") if complete else line, complete))
    return out


def split_jobs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """--events appends: one file may hold several jobs, each starting with job_started."""
    jobs: list[list[dict[str, Any]]] = []
    for e in events:
        if e["event"] == EventName.JOB_STARTED or not jobs:
            jobs.append([])
        jobs[-1].append(e)
    return jobs


# ---- analysis -----------------------------------------------------------------------------
def _t(e: dict[str, Any]) -> float:
    """An event's instant on the log's (controller's) clock."""
    t = e.get("t_log")
    return float(t if t is not None else e["t_mono"])


def _first(
    events: list[dict[str, Any]], name: str, after: float = float("-inf"), **match: Any
) -> dict[str, Any] | None:
    for e in events:
        if e["event"] == name and _t(e) >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def step_time(events: list[dict[str, Any]], fin: dict[str, Any] | None) -> float | None:
    """The failure-free step time: the controller's median over consecutive commits, or the
    median seconds per step between progress points of one epoch, whichever is smaller.
    Commit reports aggregated per node (every 100 ms) leave the controller only the slow
    steps as consecutive pairs, which can only make its median too large; progress windows
    average a few steps, which can only make theirs a little larger than a true median."""
    prog = [p for p in map(Progress.from_record, events) if p is not None and p.step is not None]
    rates = [
        (b.t - a.t) / (b.step - a.step)
        for a, b in zip(prog, prog[1:])
        if a.epoch == b.epoch and a.step is not None and b.step is not None and b.step > a.step
    ]
    fin_s = as_float(fin.get("step_s")) if fin is not None else None
    cands = ([fin_s] if fin_s else []) + ([median(rates)] if rates else [])
    return min(cands) if cands else None


def unvouched(events: list[dict[str, Any]]) -> str | None:
    """Why resild cannot vouch for the job's state (a divergence nothing rolled back), as
    job_finished says it, or a worker's state_unvouched event where the leader that ended
    the job did not hear it; None: nothing says so."""

    def first(name: str) -> dict[str, Any] | None:  # tolerant: resil-run's summary reads malformed events too
        return next((e for e in events if isinstance(e, dict) and e.get("event") == name), None)

    fin = first(EventName.JOB_FINISHED)
    if fin is not None and fin.get("unvouched"):
        return str(fin["unvouched"])
    said = first(EventName.STATE_UNVOUCHED)
    return str(said.get("reason") or "a divergence was not rolled back") if said is not None else None


def stragglers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The controller's `straggler` events: node, slowdown, replaced, hardware evidence, reason."""
    keep = ("node", "slowdown", "replaced", "evidence", "reason")
    return [
        {k: e.get(k) for k in keep} for e in events if isinstance(e, dict) and e.get("event") == EventName.STRAGGLER
    ]


def unvouched_line(reason: str) -> str:
    return f"WARNING: resild cannot vouch for this job's final state: {reason}"


def analyze(events: list[dict[str, Any]], job: int | None = None) -> Breakdown:
    """The breakdown of one job of the file (1-based `job`; default the last one)."""
    jobs = split_jobs(events)
    idx = len(jobs) if job is None else job
    if not 1 <= idx <= len(jobs):
        raise EventFileError(f"no job {idx}: the file holds {len(jobs)}")
    b = _analyze_one(sorted(jobs[idx - 1], key=_t))
    b.jobs_in_file, b.job_index = len(jobs), idx
    return b


def _analyze_one(ev: list[dict[str, Any]]) -> Breakdown:
    started = _first(ev, EventName.JOB_STARTED)
    t0 = _t(started) if started else _t(ev[0])

    def rel(t: float) -> float:
        return t - t0

    fin = _first(ev, EventName.JOB_FINISHED)
    failed = _first(ev, EventName.JOB_FAILED)
    end_ev = fin or failed
    t_end = _t(end_ev) if end_ev else max(_t(e) for e in ev)
    outcome = "finished" if fin else "failed" if failed else "incomplete"
    reason = str((end_ev or {}).get("reason", "no job_finished/job_failed event: still running, or killed"))

    m1 = _first(ev, EventName.MEMBERSHIP, epoch=1)
    all_nodes = list((started or {}).get("nodes") or [])
    active = list((m1 or {}).get("layout") or {})
    if not all_nodes:
        all_nodes = sorted({e["node"] for e in ev if e["event"] == EventName.NODE_REGISTERED})
    if not active:
        active = [e["node"] for e in ev if e["event"] == EventName.NODE_REGISTERED and e.get("role") == "active"]
    spares = [n for n in all_nodes if n not in active]

    # -- the committed-step line and the first/last commit --------------------------------
    first_commit = _first(ev, EventName.FULL_STRENGTH_STEP, epoch=1) or _first(ev, EventName.PROGRESS)
    t_first = _t(first_commit) if first_commit else None
    step_s = step_time(ev, fin)
    t_last: float | None
    if fin is not None and t_first is not None:
        t_last = t_first + float(fin.get("train_s") or 0.0)
        steps = int(fin.get("step") or 0)
    else:
        commits = [e for e in ev if e["event"] in (EventName.PROGRESS, EventName.FULL_STRENGTH_STEP)]
        t_last = max((_t(e) for e in commits), default=None)
        steps = max((int(e["step"]) for e in commits), default=0) - (int(first_commit["step"]) if first_commit else 0)
    line: list[tuple[float, int]] = []
    for e in ev:
        s = {
            EventName.PROGRESS: "step",
            EventName.FULL_STRENGTH_STEP: "step",
            EventName.RESUMED: "step",
            EventName.RANK_DONE: "step",
            EventName.FAILURE_DETECTED: "committed_step",
            EventName.FAULT_INJECTED: "step",
        }.get(e["event"])
        if s and isinstance(e.get(s), int):
            line.append((rel(_t(e)), int(e[s])))
    if fin is not None and t_last is not None and isinstance(fin.get("final_step"), int):
        line.append((rel(t_last), int(fin["final_step"])))
    line.sort()

    # -- failures -----------------------------------------------------------------------
    failures = failure_breakdowns(ev, t0, step_s)

    # -- spares left over time: spent or fenced, then joined or re-admitted (the pool refills) --
    spares_line = [(0.0, len(spares))]
    left = set(spares)
    for e in ev:
        if e["event"] == EventName.SPARE_ASSIGNED or (e["event"] == EventName.JOB_RESIZED and e.get("how") == "grow"):
            left.discard(e.get("spare") if e["event"] == EventName.SPARE_ASSIGNED else e.get("node"))
        elif e["event"] == EventName.NODE_FENCED:
            left.discard(e.get("node"))
        elif e["event"] in (EventName.NODE_ADMITTED, EventName.NODE_READMITTED) and e.get("node"):
            left.add(e["node"])
        else:
            continue
        if len(left) != spares_line[-1][1]:
            spares_line.append((rel(_t(e)), len(left)))
    # -- cold spares queued over time: asked (spares_requested), then each one that joined --
    queued_line: list[tuple[float, int]] = []
    queued = 0
    for e in ev:
        if e["event"] == EventName.SPARES_REQUESTED and isinstance(e.get("count"), int):
            queued += e["count"]
        elif e["event"] == EventName.NODE_ADMITTED and str(e.get("source", "")).startswith("slurm:"):
            queued = max(0, queued - 1)
        else:
            continue
        queued_line.append((rel(_t(e)), queued))

    # -- the partition of wall time ---------------------------------------------------
    wall = max(0.0, t_end - t0)
    startup = (t_first - t0) if t_first is not None else wall
    recov = sum(sum(f.phases.values()) for f in failures)
    totals = {p: sum(f.phases.get(p, 0.0) for f in failures) for p in PHASES}
    redone = sum(f.redone_s for f in failures)
    last_unrecovered = failures and failures[-1].recovery_s is None and failures[-1].kind in (NODE_FAILURE, REFORM)
    if t_last is None or t_first is None:
        shutdown = 0.0
        window = 0.0
    elif last_unrecovered:
        last = failures[-1]  # the job stopped after this failure was fenced
        shutdown = max(0.0, wall - last.t_fault - sum(last.phases.values()))
        window = max(0.0, wall - startup - recov - shutdown)
    else:
        shutdown = max(0.0, t_end - t_last)
        window = max(0.0, t_last - t_first)
    train_in_window = max(0.0, window - redone - (0.0 if last_unrecovered else recov))
    productive = min(steps * step_s, train_in_window) if step_s else 0.0
    idle = max(0.0, wall - startup - recov - redone - productive - shutdown)
    n_act, n_all = len(active) or 1, len(all_nodes) or 1
    training_goodput = None
    if fin is not None and step_s and fin.get("train_s"):
        training_goodput = min(1.0, steps * step_s / float(fin["train_s"]))
    return Breakdown(
        outcome=outcome,
        reason=reason,
        nodes=len(all_nodes),
        active_nodes=len(active),
        initial_spares=len(spares),
        wall_s=wall,
        startup_s=startup,
        productive_s=productive,
        recovery_s=recov,
        redone_s=redone,
        idle_s=idle,
        shutdown_s=shutdown,
        phase_totals=totals,
        steps=steps,
        step_s=step_s,
        goodput=productive / wall if wall > 0 else None,
        training_goodput=training_goodput,
        gpu_goodput=productive * n_act / (wall * n_all) if wall > 0 else None,
        failures=failures,
        unvouched=unvouched(ev),
        stragglers=stragglers(ev),
        step_line=line,
        spares_line=spares_line,
        queued_line=queued_line,
        checkpoints=ck.to_dict() if (ck := checkpoint_counts(ev)) is not None else None,
    )


def failure_breakdowns(
    ev: list[dict[str, Any]], t0: float = 0.0, step_s: float | None = None
) -> list[FailureBreakdown]:
    """The recoveries (resild.report.recoveries: the rules resil-run's table uses too), with
    times from the job's start `t0` and the redone steps' time at the median step `step_s`
    (resil-run's table shows neither: 0 and None)."""
    out: list[FailureBreakdown] = []
    for r in recoveries(ev):
        redone = r.steps_redone or 0
        out.append(
            FailureBreakdown(
                index=r.index,
                kind=r.kind,
                node=r.node,
                cause=r.cause,
                detector=r.detector,
                fault=r.fault,
                fault_time_from=r.fault_time_from,
                t_fault=r.t_fault - t0,
                phases=dict(r.phases),
                recovery_s=r.recovery_s,
                committed_step=r.committed_step,
                resumed_step=r.resumed_step,
                steps_redone=redone,
                redone_s=redone * (step_s or 0.0),
                bytes_replayed=r.bytes_replayed,
                spares_left=r.spares_left,
                epoch=r.epoch,
                overlapped=r.overlapped,
                detect_s=r.detect_s,
                replay_s=r.replay_s,
                recovered_from=r.recovered_from,
            )
        )
    return out


# ---- text ----------------------------------------------------------------------------------
def _s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _pool_over_time(b: Breakdown, most: int = 12) -> str:
    """'hot spares over time: 2 at 0.0s, 1 at 12.3s, ...; queued: 1 at 12.4s, ...' when the
    pool changed during the job ('' when it never did)."""
    if len(b.spares_line) <= 1 and not b.queued_line:
        return ""

    def points(line: list[tuple[float, int]]) -> str:
        shown = ", ".join(f"{n} at {t:.1f}s" for t, n in line[:most])
        return shown + (f", ... ({len(line) - most} more)" if len(line) > most else "")

    text = f"hot spares over time: {points(b.spares_line)}"
    return text + (f"; cold spares queued: {points(b.queued_line)}" if b.queued_line else "")


def format_breakdown(b: Breakdown) -> str:
    lines = []
    if b.jobs_in_file > 1:
        lines.append(f"(the file holds {b.jobs_in_file} jobs; this is job {b.job_index}: --job N picks another)")
    step = "-" if b.step_s is None else f"{b.step_s * 1000:.1f} ms"
    lines.append(f"job {b.outcome}: {b.reason}")
    if b.unvouched:
        lines.append(unvouched_line(b.unvouched))
    for st in b.stragglers:
        lines.append(f"straggler {'replaced' if st['replaced'] else 'reported'}: {st['reason']}")
    lines.append(
        f"{b.nodes} nodes ({b.active_nodes} training, {b.initial_spares} hot spares), "
        f"{b.steps} steps, median step {step}, wall {b.wall_s:.2f} s"
    )
    lines.append("")
    lines.append(f"{'where the time went':<26}{'seconds':>10}{'share':>9}")
    for name, v in b.parts():
        share = v / b.wall_s if b.wall_s > 0 else None
        n = len([f for f in b.failures if f.kind in (NODE_FAILURE, REFORM)])
        label = f"recovery ({n} failure{'' if n == 1 else 's'})" if name == "recovery" else name
        lines.append(f"{label:<26}{v:>10.3f}{_pct(share):>9}")
        if name == "recovery":
            for p in PHASES:
                lines.append(f"{'  ' + p:<26}{b.phase_totals[p]:>10.3f}")
    lines.append(f"{'total (wall)':<26}{b.wall_s:>10.3f}{'100.0%':>9}")
    lines.append("")
    lines.append(
        f"goodput {_pct(b.goodput)} of wall time; {_pct(b.training_goodput)} of the training window "
        f"(first -> last committed step); {_pct(b.gpu_goodput)} of all allocated "
        f"GPU time, counting the idle hot spares"
    )
    pool = _pool_over_time(b)
    if pool:
        lines.append(pool)
    if b.failures:
        lines.append("")
        hdr = (
            f"{'#':>2} {'at':>8} {'node':<13} {'fault':<22} {'detector':<13}"
            + "".join(f"{p:>11}" for p in PHASES)
            + f"{'recovery':>10}{'redone':>7}{'replayed':>10}{'spares':>7}"
        )
        lines.append(hdr)
        for f in b.failures:
            ph = (
                "".join(f"{_s(f.phases.get(p)):>11}" for p in PHASES)
                if f.phases
                else "".join(f"{'-':>11}" for _ in PHASES)
            )
            mb = f"{f.bytes_replayed / 1e6:.1f}MB" if f.bytes_replayed else "-"
            what = f.fault or ("(" + f.kind + ")")
            note = []
            if f.fault_time_from != "injected":
                note.append(f"fault time from {f.fault_time_from}")
            if f.overlapped:
                note.append("interrupted by the next failure")
            if f.kind == SPARE_LOST:
                note.append("a spare failed; training went on")
            if f.kind == BEFORE_START:
                note.append("replaced before training started; counted in start-up")
            lines.append(
                f"{f.index:>2} {f.t_fault:>7.2f}s {str(f.node or '-'):<13} {what:<22} {f.detector:<13}"
                f"{ph}{_s(f.recovery_s):>10}{f.steps_redone:>7}{mb:>10}"
                f"{'-' if f.spares_left is None else f.spares_left:>7}" + (f"  ({'; '.join(note)})" if note else "")
            )
        lines.append("   at: seconds after job start; phases in seconds; recovery = fault -> first full-strength step")
    ck = checkpoint_counts_line(b)
    if ck:
        lines.append("")
        lines.append(ck)
    return "\n".join(lines)


def checkpoint_counts_line(b: Breakdown) -> str | None:
    return CheckpointCounts(**b.checkpoints).line() if b.checkpoints is not None else None
