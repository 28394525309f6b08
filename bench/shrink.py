"""With no spare left, what does shrinking cost, against a spare taking over? What is a
shrunk step worth? And what does growing back cost? (issue 35, item 5: `resil-run
--min-replicas`.)

Two paths, side by side in one invocation, alternating run by run (spare, shrink, shrink,
spare, ...) so that neither always runs on a warmer machine, each on examples/train.py:

- ``spare`` (A, the baseline): ``resil-run --local --nodes N+1 --spares 1``: a hot spare
  takes the lost node's ranks;
- ``shrink`` (B): ``resil-run --local --nodes N --spares 0 --min-replicas (N-1) x P``: the
  job drops the lost node's ranks and trains on; once it has trained ``--window-s`` shrunk,
  ``resil-run --join RUN_DIR --local --nodes 1`` adds a spare and the job grows back (C).

On both, the node process of ``--victim`` and all its workers are SIGKILLed (the node is
lost) once the job has trained ``--window-s`` at full strength. Measured (events' ``t_mono``
is CLOCK_MONOTONIC, the bench's own clock too):

- ``recovery_s`` (A, B): the kill -> the first step committed at full strength in the next
  epoch (for a shrink: by all of the shrunk job's ranks); ``detect_s``: the kill ->
  ``failure_detected``; ``decided_s``: the kill -> the new epoch decided (``spare_assigned``
  or ``job_resized`` shrink);
- ``report_recovery_s``: the same recovery as ``resild report`` (``resild.report.recoveries``)
  times it: from the first failed collective (or the detection; ``report_from`` says which),
  as it cannot know the kill's instant, to the first full-strength step; None: the report
  did not see the node's recovery;
- ``grow_decided_s`` (C): ``--join`` started -> ``job_resized`` (grow), the newcomer qualified
  and warm; ``grow_full_s``: ``--join`` started -> the first step at full width again;
  ``grow_s``: the grow's decision -> that step;
- ``full_step_s`` / ``shrunk_step_s`` / ``grown_step_s`` (D): the median step time over the
  window before the kill, the shrunk window, and ``--window-s``/2 after the grow, from the
  committed steps of the ``progress`` events (one every 0.5 s). The per-rank batch is kept, so
  a shrunk step carries (N-1)/N of the samples: samples/s shrunk / full = (N-1)/N / step ratio.

Summary: medians of ``--runs`` runs of each path, each with its spread (min-max);
``recovery_ratio`` = median shrink / median spare recovery_s (spread: the per-run pairs');
``step_ratio`` = median of each shrink run's shrunk / full step time. Nothing here asserts
on timings: it prints what it measured.

    python bench/shrink.py [--runs 3] [--nodes 3] [--nproc-per-node 1] [--window-s 4]
                           [--victim local-node0] [--events-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root on sys.path for `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import resil_run, train
from bench.join_spare import VICTIM, _events, _wait, alternate, median_of, report, running
from resild.report.recoveries import NODE_FAILURE, recoveries

Event = Mapping[str, Any]


# ---- pure: events -> durations ---------------------------------------------------------------
def step_times(events: Sequence[Event], t0: float, t1: float) -> list[float]:
    """Seconds per committed step between consecutive ``progress`` points in [t0, t1] of one
    epoch (a pair across epochs, or with no new step, is left out). Pure."""
    pts = [e for e in events if e.get("event") == "progress" and t0 <= float(e["t_mono"]) <= t1]
    out = []
    for a, b in zip(pts, pts[1:]):
        steps = int(b["step"]) - int(a["step"])
        if steps > 0 and a.get("epoch") == b.get("epoch"):
            out.append((float(b["t_mono"]) - float(a["t_mono"])) / steps)
    return out


def median_step_s(events: Sequence[Event], t0: float, t1: float) -> float | None:
    """The median of `step_times` (to the microsecond), or None with no pair in the window. Pure."""
    xs = step_times(events, t0, t1)
    return round(statistics.median(xs), 6) if xs else None


def next_epoch_step(events: Sequence[Event], after_epoch: int) -> Event | None:
    """The first step committed at full strength in an epoch after `after_epoch`. Pure."""
    return next(
        (e for e in events if e.get("event") == "full_strength_step" and int(e.get("epoch", 0)) > after_epoch), None
    )


def first(events: Sequence[Event], event: str, after: float = float("-inf"), **match: Any) -> Event | None:
    """The first `event` at or after `after` whose fields equal `match`. Pure."""
    return next(
        (
            e
            for e in events
            if e.get("event") == event and float(e["t_mono"]) >= after and all(e.get(k) == v for k, v in match.items())
        ),
        None,
    )


def _d(a: float | None, b: Event | None, digits: int = 4) -> float | None:
    return None if a is None or b is None else round(float(b["t_mono"]) - a, digits)


def measure(
    events: Sequence[Event], path: str, t_kill: float, t_join: float | None = None, t_end: float | None = None
) -> dict[str, Any]:
    """One run's durations from its events: the node lost at `t_kill`, the spare's ``--join``
    started at `t_join` (shrink path), the grown window ending at `t_end`. Pure.

    Keys: recovery_s, detect_s, decided_s, full_step_s; shrink path: shrunk_step_s,
    grow_decided_s, grow_full_s, grow_s, grown_step_s (None where the run never got there)."""
    start = first(events, "full_strength_step", epoch=1)
    before = [e for e in events if float(e["t_mono"]) <= t_kill and e.get("event") in ("membership", "progress")]
    epoch = max((int(e["epoch"]) for e in before if e.get("epoch") is not None), default=1)
    back = next_epoch_step([e for e in events if float(e["t_mono"]) >= t_kill], epoch)
    if path == "shrink":
        decided = first(events, "job_resized", t_kill, how="shrink")
    else:
        decided = first(events, "spare_assigned", t_kill)
    out: dict[str, Any] = {
        "recovery_s": _d(t_kill, back),
        "detect_s": _d(t_kill, first(events, "failure_detected", t_kill)),
        "decided_s": _d(t_kill, decided),
        "full_step_s": median_step_s(events, float(start["t_mono"]), t_kill) if start is not None else None,
    }
    if path != "shrink":
        return out
    grew = first(events, "job_resized", t_join, how="grow") if t_join is not None else None
    full = next_epoch_step(events, int(grew["epoch"]) - 1) if grew is not None else None
    if back is not None:
        out["shrunk_step_s"] = median_step_s(events, float(back["t_mono"]), t_join if t_join is not None else t_kill)
    out["grow_decided_s"] = _d(t_join, grew, 3)
    out["grow_full_s"] = _d(t_join, full, 3)
    out["grow_s"] = _d(float(grew["t_mono"]) if grew is not None else None, full)
    if full is not None and t_end is not None:
        out["grown_step_s"] = median_step_s(events, float(full["t_mono"]), t_end)
    return out


def report_recovery(events: Sequence[Event]) -> tuple[float | None, str | None]:
    """The lost node's recovery as ``resild report`` times it: (recovery_s, where its start
    came from); (None, None) when the report found no node failure."""
    node = [r for r in recoveries(events) if r.kind == NODE_FAILURE]
    if not node:
        return None, None
    s = node[0].recovery_s
    return (round(s, 4) if s is not None else None), node[0].fault_time_from


def spread(xs: Sequence[float | None]) -> tuple[float, float] | None:
    """(min, max) of the values that are not None; None when there are none. Pure."""
    v = [x for x in xs if x is not None]
    return (min(v), max(v)) if v else None


def _ratio(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _with_spread(median: float | None, xs: Sequence[float | None]) -> dict[str, Any]:
    sp = spread(xs)
    r = {"median": median, "min": sp[0] if sp else None, "max": sp[1] if sp else None}
    return {k: (round(v, 3) if v is not None else None) for k, v in r.items()}


def summarize(runs: Sequence[dict[str, Any]], nodes: int) -> dict[str, Any]:
    """Medians and spreads over the runs (each with "path": "spare" or "shrink"). Pure.

    recovery_ratio: median shrink / median spare recovery_s; its spread (and "pairs"): run
    i's shrink / run i's spare. step_ratio: the median (and spread) of each shrink run's
    shrunk / full step time; samples_ratio: (N-1)/N / step_ratio, the throughput kept."""
    rs = list(runs)

    def stat(path: str, key: str) -> dict[str, Any]:
        sp = spread([r.get(key) for r in rs if r["path"] == path])
        lo, hi = (round(sp[0], 4), round(sp[1], 4)) if sp else (None, None)
        return {"median": median_of(rs, path, key), "min": lo, "max": hi}

    spare = [r for r in rs if r["path"] == "spare"]
    shrink = [r for r in rs if r["path"] == "shrink"]
    pairs = [_ratio(k.get("recovery_s"), s.get("recovery_s")) for s, k in zip(spare, shrink)]
    steps = [_ratio(r.get("shrunk_step_s"), r.get("full_step_s")) for r in shrink]
    grown = [_ratio(r.get("grown_step_s"), r.get("full_step_s")) for r in shrink]
    out: dict[str, Any] = {
        "spare_recovery_s": stat("spare", "recovery_s"),
        "shrink_recovery_s": stat("shrink", "recovery_s"),
        "spare_decided_s": stat("spare", "decided_s"),
        "shrink_decided_s": stat("shrink", "decided_s"),
        "spare_report_recovery_s": stat("spare", "report_recovery_s"),
        "shrink_report_recovery_s": stat("shrink", "report_recovery_s"),
        "grow_decided_s": stat("shrink", "grow_decided_s"),
        "grow_full_s": stat("shrink", "grow_full_s"),
        "grow_s": stat("shrink", "grow_s"),
        "full_step_s": stat("shrink", "full_step_s"),
        "shrunk_step_s": stat("shrink", "shrunk_step_s"),
        "grown_step_s": stat("shrink", "grown_step_s"),
    }
    s, k = out["spare_recovery_s"]["median"], out["shrink_recovery_s"]["median"]
    out["recovery_ratio"] = _with_spread(_ratio(k, s), pairs)
    out["recovery_ratio"]["pairs"] = [round(x, 3) if x is not None else None for x in pairs]
    out["step_ratio"] = _with_spread(_median([x for x in steps if x is not None]), steps)
    out["grown_step_ratio"] = _with_spread(_median([x for x in grown if x is not None]), grown)
    keep = (nodes - 1) / nodes
    sr = out["step_ratio"]
    out["samples_ratio"] = {
        key: (round(keep / v, 3) if v else None)
        for key, v in (("median", sr["median"]), ("min", sr["max"]), ("max", sr["min"]))
    }
    return out


def _cell(s: Mapping[str, Any], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    if s.get("median") is None:
        return "-"
    f = f"{{:.{digits}f}}"
    lo, hi = s.get("min"), s.get("max")
    sp = f" ({f.format(lo * scale)}-{f.format(hi * scale)})" if lo is not None and hi is not None else ""
    return f.format(s["median"] * scale) + (f" {unit}" if unit else "") + sp


def table(summary: Mapping[str, Any], runs: int) -> str:
    """The human table: median (min-max) of each measure. Pure."""
    s = summary
    rows = [
        ("(A) spare takes over: kill -> full strength", _cell(s["spare_recovery_s"])),
        ("(B) shrink: kill -> full strength (shrunk epoch)", _cell(s["shrink_recovery_s"])),
        ("    B / A (of the medians; the pairs' min-max)", _cell(s["recovery_ratio"], "")),
        ("    kill -> decided: spare assigned", _cell(s["spare_decided_s"])),
        ("    kill -> decided: job_resized shrink", _cell(s["shrink_decided_s"])),
        ("    resild report's recovery_s: spare", _cell(s["spare_report_recovery_s"])),
        ("    resild report's recovery_s: shrink", _cell(s["shrink_report_recovery_s"])),
        ("(C) --join -> job_resized grow", _cell(s["grow_decided_s"])),
        ("    --join -> full strength (grown epoch)", _cell(s["grow_full_s"])),
        ("    grow decided -> full strength", _cell(s["grow_s"])),
        ("(D) step time, full width", _cell(s["full_step_s"], "ms", 1000.0, 1)),
        ("    step time, shrunk", _cell(s["shrunk_step_s"], "ms", 1000.0, 1)),
        ("    step time, grown back", _cell(s["grown_step_s"], "ms", 1000.0, 1)),
        ("    shrunk / full step time", _cell(s["step_ratio"], "")),
        ("    grown / full step time", _cell(s["grown_step_ratio"], "")),
        ("    samples/s shrunk / full", _cell(s["samples_ratio"], "")),
    ]
    w = max(len(r[0]) for r in rows)
    head = f"{'':{w}}  median of {runs} (min-max)"
    return "\n".join([head, *(f"{a:{w}}  {b}" for a, b in rows)])


# ---- the runs ----------------------------------------------------------------------------------
def one_run(
    path: str, nodes: int, nproc: int, window_s: float, victim: str, keep: Path | None, tmp: Path
) -> dict[str, Any]:
    """One job on `path` ("spare" or "shrink"): lose `victim` after `window_s` at full strength;
    on the shrink path a spare joins after `window_s` shrunk. -> its measurements."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir, events = tmp / "run", tmp / "events.jsonl"
    extra = [] if path == "spare" else ["--min-replicas", str((nodes - 1) * nproc)]
    spares = 1 if path == "spare" else 0
    cmd = resil_run(
        *("--run-dir", str(run_dir), "--events", str(events), "--quiet", *extra),
        nodes=nodes + spares,
        spares=spares,
        nproc_per_node=nproc,
        worker=train(1_000_000),  # stopped by the bench once it measured
    )
    t_join = t_end = None
    try:
        with running(path, cmd, tmp) as r:
            job = r.job
            start = _wait(events, lambda e: e["event"] == "full_strength_step", "the first step", job)
            if path == "spare":
                spare = f"local-node{nodes}"
                for _ in range(nproc):
                    _wait(
                        events, lambda e: e["event"] == "worker_registered" and e.get("node") == spare, "the spare", job
                    )
            time.sleep(max(0.0, start["t_mono"] + window_s - time.monotonic()))
            regs = [e["pid"] for e in _events(events) if e["event"] == "node_registered" and e["node"] == victim]
            if not regs:
                raise RuntimeError(f"no node {victim} registered")
            t_kill = time.monotonic()
            os.killpg(regs[-1], signal.SIGKILL)  # the node is lost: its node process and every worker
            back = _wait(events, lambda e: next_epoch_step([e], 1) is not None, "full strength", job)
            if path == "shrink":
                resized = [e for e in _events(events) if e["event"] == "job_resized"]
                if not resized or resized[0]["how"] != "shrink":
                    raise RuntimeError(f"no shrink: {resized}")
                time.sleep(max(0.0, back["t_mono"] + window_s - time.monotonic()))
                t_join = time.monotonic()
                r.join(run_dir)
                grew = _wait(events, lambda e: e["event"] == "job_resized" and e["how"] == "grow", "the grow", job)
                full = _wait(
                    events, lambda e: next_epoch_step([e], int(grew["epoch"]) - 1) is not None, "full width", job
                )
                time.sleep(max(0.0, full["t_mono"] + window_s / 2 - time.monotonic()))
                t_end = time.monotonic()
        evs = _events(events)
    finally:
        if keep is not None and events.exists():
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(events, keep / f"{tmp.name}.jsonl")
    out: dict[str, Any] = {"path": path, **measure(evs, path, t_kill, t_join, t_end)}
    out["report_recovery_s"], out["report_from"] = report_recovery(evs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of each path (alternating)")
    p.add_argument("--nodes", type=int, default=3, help="active nodes (the spare path adds its one spare)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--window-s", type=float, default=4.0, help="seconds trained at full width, then shrunk")
    p.add_argument("--victim", default=VICTIM, help="the node lost (default %(default)s: rank 0's)")
    p.add_argument("--events-dir", type=Path, help="keep each run's events file here")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.runs < 1 or a.nodes < 2 or a.nproc_per_node < 1 or a.window_s <= 0:
        p.error("--runs >= 1, --nodes >= 2 (a survivor trains on), --nproc-per-node >= 1, --window-s > 0")
    if a.victim not in {f"local-node{i}" for i in range(a.nodes)}:
        p.error(f"--victim: one of the active nodes, local-node0 .. local-node{a.nodes - 1}")

    def one(path: str, tmp: Path) -> dict[str, Any]:
        return one_run(path, a.nodes, a.nproc_per_node, a.window_s, a.victim, a.events_dir, tmp)

    runs = alternate(("spare", "shrink"), a.runs, one, a.json)
    summary = summarize(runs, a.nodes)
    if a.json:
        report(runs, summary, True)
    else:
        print(table(summary, a.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
