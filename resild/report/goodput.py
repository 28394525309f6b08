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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

PHASES = ("detection", "fence", "re-form", "replay", "first step")


class EventFileError(ValueError):
    """The event file cannot be read as a resild event log (message fit for one line)."""


@dataclass
class FailureBreakdown:
    index: int
    kind: str  # "node failure", "spare lost", "re-form" (transient; no node lost)
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
    jobs_in_file: int = 1
    job_index: int = 1

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
        d["step_line"] = [[round(t, 4), s] for t, s in self.step_line]
        d["spares_line"] = [[round(t, 4), s] for t, s in self.spares_line]
        return d


# ---- reading ----------------------------------------------------------------------------
def load_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines event file. Raises EventFileError with a one-line reason."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EventFileError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise EventFileError(f"{p}: is a directory, not an event file") from None
    except UnicodeDecodeError:
        raise EventFileError(f"{p}: not a text file (expected JSON lines from resil-run --events)") from None
    except OSError as e:
        raise EventFileError(f"{p}: {e.strerror}") from None
    lines = text.splitlines()
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines) and not text.endswith("\n"):
                break  # the last line of a log still being written
            raise EventFileError(
                f"{p}:{n}: not JSON ({e.msg}); expected one event per line as written by resil-run --events"
            ) from None
        if (
            not isinstance(rec, dict)
            or not isinstance(rec.get("event"), str)
            or not isinstance(rec.get("t_mono"), (int, float))
        ):
            raise EventFileError(f'{p}:{n}: not a resild event (needs "event" and "t_mono")')
        out.append(rec)
    if not out:
        raise EventFileError(f"{p}: empty (no events)")
    return out


def split_jobs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """--events appends: one file may hold several jobs, each starting with job_started."""
    jobs: list[list[dict[str, Any]]] = []
    for e in events:
        if e["event"] == "job_started" or not jobs:
            jobs.append([])
        jobs[-1].append(e)
    return jobs


# ---- analysis -----------------------------------------------------------------------------
def _t(e: dict[str, Any]) -> float:
    """An event's instant on the log's (controller's) clock."""
    return float(e.get("t_log", e["t_mono"]))


def _first(events: list[dict], name: str, after: float = float("-inf"), **match: Any) -> dict | None:
    for e in events:
        if e["event"] == name and _t(e) >= after and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def step_time(events: list[dict], fin: dict | None) -> float | None:
    """The failure-free step time: the controller's median over consecutive commits, or the
    median seconds per step between progress points of one epoch, whichever is smaller.
    Commit reports aggregated per node (every 100 ms) leave the controller only the slow
    steps as consecutive pairs, which can only make its median too large; progress windows
    average a few steps, which can only make theirs a little larger than a true median."""
    prog = [e for e in events if e["event"] == "progress"]
    rates = [
        (_t(b) - _t(a)) / (b["step"] - a["step"])
        for a, b in zip(prog, prog[1:])
        if a.get("epoch") == b.get("epoch") and b["step"] > a["step"]
    ]
    cands = ([float(fin["step_s"])] if fin is not None and fin.get("step_s") else []) + (
        [median(rates)] if rates else []
    )
    return min(cands) if cands else None


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
    started = _first(ev, "job_started")
    t0 = _t(started) if started else _t(ev[0])
    rel = lambda t: t - t0  # noqa: E731
    fin = _first(ev, "job_finished")
    failed = _first(ev, "job_failed")
    end_ev = fin or failed
    t_end = _t(end_ev) if end_ev else max(_t(e) for e in ev)
    outcome = "finished" if fin else "failed" if failed else "incomplete"
    reason = str((end_ev or {}).get("reason", "no job_finished/job_failed event: still running, or killed"))

    m1 = _first(ev, "membership", epoch=1)
    all_nodes = list((started or {}).get("nodes") or [])
    active = list((m1 or {}).get("layout") or {})
    if not all_nodes:
        all_nodes = sorted({e["node"] for e in ev if e["event"] == "node_registered"})
    if not active:
        active = [e["node"] for e in ev if e["event"] == "node_registered" and e.get("role") == "active"]
    spares = [n for n in all_nodes if n not in active]

    # -- the committed-step line and the first/last commit --------------------------------
    first_commit = _first(ev, "full_strength_step", epoch=1) or _first(ev, "progress")
    t_first = _t(first_commit) if first_commit else None
    step_s = step_time(ev, fin)
    if fin is not None and t_first is not None:
        t_last = t_first + float(fin.get("train_s") or 0.0)
        steps = int(fin.get("step") or 0)
    else:
        commits = [e for e in ev if e["event"] in ("progress", "full_strength_step")]
        t_last = max((_t(e) for e in commits), default=None)
        steps = max((int(e["step"]) for e in commits), default=0) - (int(first_commit["step"]) if first_commit else 0)
    line: list[tuple[float, int]] = []
    for e in ev:
        s = {
            "progress": "step",
            "full_strength_step": "step",
            "resumed": "step",
            "rank_done": "step",
            "failure_detected": "committed_step",
            "fault_injected": "step",
        }.get(e["event"])
        if s and isinstance(e.get(s), int):
            line.append((rel(_t(e)), int(e[s])))
    if fin is not None and t_last is not None and isinstance(fin.get("final_step"), int):
        line.append((rel(t_last), int(fin["final_step"])))
    line.sort()

    # -- failures -----------------------------------------------------------------------
    failures = _failures(ev, t0, step_s, set(active))

    # -- spares left over time --------------------------------------------------------------
    spares_line = [(0.0, len(spares))]
    left = set(spares)
    for e in ev:
        if e["event"] == "spare_assigned":
            left.discard(e.get("spare"))
        elif e["event"] == "node_fenced":
            left.discard(e.get("node"))
        else:
            continue
        if len(left) != spares_line[-1][1]:
            spares_line.append((rel(_t(e)), len(left)))

    # -- the partition of wall time ---------------------------------------------------
    wall = max(0.0, t_end - t0)
    startup = (t_first - t0) if t_first is not None else wall
    recov = sum(sum(f.phases.values()) for f in failures)
    totals = {p: sum(f.phases.get(p, 0.0) for f in failures) for p in PHASES}
    redone = sum(f.redone_s for f in failures)
    last_unrecovered = failures and failures[-1].recovery_s is None and failures[-1].kind != "spare lost"
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
        step_line=line,
        spares_line=spares_line,
    )


def _failures(ev: list[dict], t0: float, step_s: float | None, layout: set[str]) -> list[FailureBreakdown]:
    out: list[FailureBreakdown] = []
    used_faults: set[int] = set()
    timed: list[tuple[FailureBreakdown, list[float]]] = []
    prev_end = t0
    for e in ev:
        if e["event"] == "membership":
            layout = set(e.get("layout") or {})
        if e["event"] not in ("failure_detected", "reform"):
            continue
        t_det = _t(e)
        node = e.get("node")
        # The fault that led here: the latest injection on that node not yet matched.
        fault = None
        for x in ev:
            if (
                x["event"] == "fault_injected"
                and id(x) not in used_faults
                and _t(x) <= t_det
                and (node is None or x.get("node") == node)
            ):
                fault = x
        if fault is not None:
            used_faults.add(id(fault))
        coll = next((x for x in ev if x["event"] == "collective_failed" and prev_end <= _t(x) <= t_det), None)
        if fault is not None:
            t_fault, src = _t(fault), "injected"
        elif coll is not None:
            t_fault, src = _t(coll), "collective failure"
        else:
            t_fault, src = t_det, "detection"
        if e["event"] == "reform":
            kind, ep, assigned = "re-form", e.get("epoch"), None
            t_fence = t_det
        else:
            assigned = _first(ev, "spare_assigned", after=t_det, failed=node)
            kind = "node failure" if node in layout else "spare lost"
            ep = assigned.get("epoch") if assigned else None
            fenced = _first(ev, "node_fenced", after=t_det, node=node)
            t_fence = _t(fenced) if fenced else t_det
        f = FailureBreakdown(
            index=len(out) + 1,
            kind=kind,
            node=node,
            cause=str(e.get("cause") or e.get("reason", "")),
            detector=str(e.get("detector", "probe" if kind == "re-form" else "")),
            fault=fault.get("spec") if fault else None,
            fault_time_from=src,
            t_fault=t_fault - t0,
            committed_step=e.get("committed_step"),
            epoch=ep,
            spares_left=assigned.get("spares_left") if assigned else None,
        )
        bounds = [t_fault, t_det, t_fence]
        if kind == "spare lost":
            f.phases = {}  # training never stopped
            out.append(f)
            continue
        if ep is not None:
            later = [x for x in ev if _t(x) >= t_det]
            full = next((x for x in later if x["event"] == "full_strength_step" and x.get("epoch", 0) >= ep), None)
            resumed = _first(later, "resumed", epoch=ep)
            reformed = _first(later, "group_reformed", epoch=ep)
            replayed = [x for x in later if x["event"] == "state_replayed" and x.get("epoch") == ep]
            f.bytes_replayed = sum(int(x.get("bytes", 0)) for x in replayed)
            if full is not None:
                t_full = _t(full)
                t_res = _t(resumed) if resumed else t_full
                # Replay ends when the last receiver has the state; it starts when rank 0's new
                # group was formed (its recovery seconds minus its formation seconds, before t_res).
                t_replayed = max([t_res] + [_t(x) for x in replayed])
                if resumed is not None and reformed is not None:
                    t_formed = t_res - max(0.0, float(resumed["seconds"]) - float(reformed["seconds"]))
                else:
                    t_formed = t_replayed - max((float(x["seconds"]) for x in replayed), default=0.0)
                bounds += [t_formed, t_replayed, t_full]
                f.recovery_s = t_full - t_fault
                if resumed is not None:
                    f.resumed_step = int(resumed["step"])
                    if f.committed_step is not None:
                        f.steps_redone = max(0, int(f.committed_step) - f.resumed_step)
                        f.redone_s = f.steps_redone * (step_s or 0.0)
            else:
                bounds += [t_fence] * 3  # never back to full strength: the rest is the job stopping
        else:
            bounds += [t_fence] * 3  # no spare: the job stopped (counted as shutdown)
        out.append(f)
        timed.append((f, bounds))
        prev_end = bounds[-1]
    # Boundaries are made monotone and clipped at the next failure's start, so the phases
    # of overlapping failures (a fault during a recovery) never count the same second twice.
    for i, (f, b) in enumerate(timed):
        nxt = timed[i + 1][0].t_fault + t0 if i + 1 < len(timed) else float("inf")
        f.overlapped = nxt < b[-1]
        cap = min(b[-1], nxt)
        mono: list[float] = []
        for x in b:
            mono.append(min(max(x, mono[-1] if mono else x), cap))
        f.phases = {p: mono[k + 1] - mono[k] for k, p in enumerate(PHASES)}
    return out


# ---- text ----------------------------------------------------------------------------------
def _s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def format_breakdown(b: Breakdown) -> str:
    lines = []
    if b.jobs_in_file > 1:
        lines.append(f"(the file holds {b.jobs_in_file} jobs; this is job {b.job_index}: --job N picks another)")
    step = "-" if b.step_s is None else f"{b.step_s * 1000:.1f} ms"
    lines.append(f"job {b.outcome}: {b.reason}")
    lines.append(
        f"{b.nodes} nodes ({b.active_nodes} training, {b.initial_spares} hot spares), "
        f"{b.steps} steps, median step {step}, wall {b.wall_s:.2f} s"
    )
    lines.append("")
    lines.append(f"{'where the time went':<26}{'seconds':>10}{'share':>9}")
    for name, v in b.parts():
        share = v / b.wall_s if b.wall_s > 0 else None
        n = len([f for f in b.failures if f.kind != "spare lost"])
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
            if f.kind == "spare lost":
                note.append("a spare failed; training went on")
            lines.append(
                f"{f.index:>2} {f.t_fault:>7.2f}s {str(f.node or '-'):<13} {what:<22} {f.detector:<13}"
                f"{ph}{_s(f.recovery_s):>10}{f.steps_redone:>7}{mb:>10}"
                f"{'-' if f.spares_left is None else f.spares_left:>7}" + (f"  ({'; '.join(note)})" if note else "")
            )
        lines.append("   at: seconds after job start; phases in seconds; recovery = fault -> first full-strength step")
    return "\n".join(lines)
