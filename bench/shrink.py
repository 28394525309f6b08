"""With no spare left, what does shrinking cost, against a spare taking over? And what does
growing back cost? (issue 35, item 5: `resil-run --min-replicas`.)

Two paths, side by side in one invocation, alternating run by run:

- ``spare``:  ``resil-run --local --nodes N+1 --spares 1``: a hot spare takes the lost
  node's ranks (the baseline);
- ``shrink``: ``resil-run --local --nodes N --spares 0 --min-replicas (N-1) x P``: the job
  drops the lost node's ranks and trains on; once it has trained ``--window-s`` shrunk,
  ``resil-run --join RUN_DIR --local --nodes 1`` adds a spare and the job grows back.

On both, the node process of ``local-node0`` and its workers are SIGKILLed once the job has
trained ``--window-s`` at full strength. Measured (events' ``t_mono`` is the bench's clock):

- ``recovery_s``: the kill -> the first step committed in the next epoch;
- ``full_steps_s`` / ``shrunk_steps_s`` (shrink): committed steps per second over the window
  before the kill and the window after the shrink (``progress`` events). The per-rank batch
  is kept, so a shrunk step carries (N-1)/N of the samples: the throughput loss is the step
  rate's change times that;
- ``grow_decided_s``: ``--join`` started -> ``job_resized`` (grow), the newcomer qualified and
  warm; ``grow_s``: the grow's decision -> the first step committed at full width again.

``ratio`` = median shrink recovery_s / median spare recovery_s; ``rate_ratio`` = median
shrunk / full step rate. Nothing here asserts on timings: it prints what it measured.

    python bench/shrink.py [--runs 3] [--nodes 3] [--nproc-per-node 1] [--window-s 4] [--json]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root on sys.path for `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import resil_run, train
from bench.join_spare import VICTIM, _events, _wait, alternate, median_of, report, running


def step_rate(events: Sequence[dict[str, Any]], t0: float, t1: float) -> float | None:
    """Committed steps per second between t0 and t1, from the progress points in it. Pure."""
    pts = [
        (float(e["t_mono"]), int(e["step"])) for e in events if e.get("event") == "progress" and t0 <= e["t_mono"] <= t1
    ]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def next_epoch_step(events: Sequence[dict[str, Any]], after_epoch: int) -> dict[str, Any] | None:
    """The first step committed at full strength in an epoch after `after_epoch`. Pure."""
    return next(
        (e for e in events if e.get("event") == "full_strength_step" and int(e.get("epoch", 0)) > after_epoch), None
    )


def one_run(path: str, nodes: int, nproc: int, window_s: float, tmp: Path) -> dict[str, Any]:
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
    out: dict[str, Any] = {"path": path}
    with running(path, cmd, tmp) as r:
        job = r.job
        first = _wait(events, lambda e: e["event"] == "full_strength_step", "the first step", job)
        if path == "spare":
            spare = f"local-node{nodes}"
            for _ in range(nproc):
                _wait(events, lambda e: e["event"] == "worker_registered" and e.get("node") == spare, "the spare", job)
        time.sleep(max(0.0, first["t_mono"] + window_s - time.monotonic()))
        pid = [e["pid"] for e in _events(events) if e["event"] == "node_registered" and e["node"] == VICTIM][-1]
        t_kill = time.monotonic()
        os.killpg(pid, signal.SIGKILL)  # the node is lost: its node process and every worker
        full = _wait(events, lambda e: next_epoch_step([e], 1) is not None, "full strength", job)
        out["recovery_s"] = round(full["t_mono"] - t_kill, 4)
        if path == "shrink":
            resized = [e for e in _events(events) if e["event"] == "job_resized"]
            if not resized or resized[0]["how"] != "shrink":
                raise RuntimeError(f"no shrink: {resized}")
            time.sleep(max(0.0, full["t_mono"] + window_s - time.monotonic()))
            evs = _events(events)
            out["full_steps_s"] = step_rate(evs, first["t_mono"], t_kill)
            out["shrunk_steps_s"] = step_rate(evs, full["t_mono"], time.monotonic())
            t_join = time.monotonic()
            r.join(run_dir)
            grew = _wait(events, lambda e: e["event"] == "job_resized" and e["how"] == "grow", "the grow", job)
            back = _wait(events, lambda e: next_epoch_step([e], int(grew["epoch"]) - 1) is not None, "full width", job)
            out["grow_decided_s"] = round(grew["t_mono"] - t_join, 3)
            out["grow_s"] = round(back["t_mono"] - grew["t_mono"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of each path (alternating)")
    p.add_argument("--nodes", type=int, default=3, help="active nodes (the spare path adds its one spare)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--window-s", type=float, default=4.0, help="seconds trained at full width, then shrunk")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.runs < 1 or a.nodes < 2 or a.nproc_per_node < 1 or a.window_s <= 0:
        p.error("--runs >= 1, --nodes >= 2 (a survivor trains on), --nproc-per-node >= 1, --window-s > 0")
    runs = alternate(
        ("spare", "shrink"), a.runs, lambda path, tmp: one_run(path, a.nodes, a.nproc_per_node, a.window_s, tmp), a.json
    )
    rates = [r["shrunk_steps_s"] / r["full_steps_s"] for r in runs if r.get("shrunk_steps_s") and r.get("full_steps_s")]
    summary: dict[str, Any] = {
        "spare_recovery_s": median_of(runs, "spare", "recovery_s"),
        "shrink_recovery_s": median_of(runs, "shrink", "recovery_s"),
        "grow_decided_s": median_of(runs, "shrink", "grow_decided_s"),
        "grow_s": median_of(runs, "shrink", "grow_s"),
        "rate_ratio": round(statistics.median(rates), 3) if rates else None,
    }
    s, k = summary["spare_recovery_s"], summary["shrink_recovery_s"]
    summary["ratio"] = round(k / s, 3) if s and k else None
    report(runs, summary, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
