"""What watching for stragglers costs, and what replacing one wins back (issue 37).

Two measurements in one invocation, each a pair of variants side by side, their order
rotated round by round so that neither always runs on a warmer machine:

1. **Pace overhead** on the failure-free step. ``resil-run --local --nodes 3 --spares 0``
   of ``examples/train.py --steps N`` with ``--stragglers report`` (every worker times its
   own steps, the node processes carry the paces in their commit reports, the controller
   judges them) against ``--stragglers off`` (no pace measured, sent nor judged). Per run:
   ``step_ms``, the job's median step (resil-run's ``--json`` summary); per variant the
   median over runs, and ``ratio`` = report / off. The pace itself is two
   ``time.monotonic()`` calls a step: at a step of tens of milliseconds its cost is far
   below what two cores shared by a dozen processes let a few runs resolve, so read the
   ratio against the spread of the runs (``runs`` lists them all). The same runs count the
   ``straggler`` events said in a job with no slow node (``false_stragglers``, the largest
   ``max_false_slowdown``): the noise floor of the threshold used below.

2. **A node 30% slow** (``--inject slow:node1@STEP+30%``: its workers sleep 30% of their
   own step from then on) in ``--nodes 4 --spares 1`` (three active, one warm spare), with
   ``--stragglers replace`` against the same job with ``--stragglers report`` (found, not
   handled). The worker is this file's own loop (``worker``: examples/train.py's model and
   data, a larger batch), because a replacement pays only when the slow node's excess pace
   times the steps left exceeds what a recovery costs (5 s before the job has measured
   one): examples/train.py's few milliseconds of compute a step would need thousands of
   steps. The node turns slow at step 30, before any node's window (5 warm-up steps, then
   ``--straggler-window``) is full: on two busy cores a fault-free node is sometimes found
   30-50% slower (see ``false_stragglers``), and a node replaced on such noise before the
   fault would leave no spare for it (``replaced_node``, ``replaced_other``: a replacement
   that took another node). From the run's events.jsonl (controller clock; ``progress`` is a committed step
   at most every 0.5 s): ``before_sps``, steps per second from the first full-strength
   step to ``fault_injected``; ``during_sps``, from the fault to the replacement's
   ``straggler`` event (to the end of the job when it is not replaced); ``after_sps``,
   from the replacement's first full-strength step to the end; ``detect_s``, from the
   fault to the first ``straggler`` event naming the node; ``replace_s``, from the
   ``straggler`` event that replaced it to the new epoch's first commit; ``regained`` =
   after / before; ``train_s``, the job's training time (the net effect, side by side).

Nothing asserts on timings. The threshold and window are printed with the results; two
busy cores make a node's pace vary by tens of percent from node to node (the false
stragglers above), which is why the default threshold is the flag's own 0.25, not lower.

    python bench/stragglers.py [--runs 2] [--steps 400] [--slow-steps 800] [--json]
    python bench/stragglers.py --quick --json      # the shape only (the tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script (and as a job's worker)
    sys.path.insert(0, str(REPO_ROOT))

from bench.commands import REPO, resil_run, train  # noqa: E402
from bench.common import read_events, select  # noqa: E402

OVERHEAD = {"on": ["--stragglers", "report"], "off": ["--stragglers", "off"]}  # pace measured, or not
SLOW = {"replace": ["--stragglers", "replace"], "report": ["--stragglers", "report"]}
SLOW_NODE = "local-node1"
SLOW_PCT = 30


# ---- the worker (a job's training process) --------------------------------------------
def worker(argv: list[str]) -> int:
    """examples/train.py's model, data and optimizer, with a batch big enough that a rank's
    own compute (its pace) is most of its step."""
    import torch
    import torch.nn.functional as F

    import launcher
    from examples.train import build_model, make_batch

    p = argparse.ArgumentParser(prog="bench/stragglers.py worker")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, default=512)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    job = launcher.init(model, opt)
    for step in job.steps(a.steps):
        opt.zero_grad()
        x, y = make_batch(0, step, job.rank, a.batch)
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        job.commit()
    job.close()
    return 0


# ---- one job ----------------------------------------------------------------------------
def _job(tmp: Path, flags: list[str], worker_cmd: list[str], nodes: int, spares: int) -> tuple[int, Any, str, Path]:
    events = tmp / "events.jsonl"
    cmd = resil_run(
        "--events", str(events), "--run-dir", str(tmp / "run"), "--json", *flags,
        worker=worker_cmd, nodes=nodes, spares=spares,
    )  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    try:
        summary = json.loads(p.stdout) if p.returncode == 0 else None
    except ValueError:
        summary = None
    return p.returncode, summary, p.stderr, events


def _ms(s: Any) -> float | None:
    return round(s * 1000, 3) if isinstance(s, (int, float)) else None


def _error(rc: int, stderr: str) -> list[str]:
    return stderr.strip().splitlines()[-1:] or [f"exit {rc}"]


def overhead_run(name: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    flags = [*OVERHEAD[name], "--straggler-threshold", str(a.threshold), "--straggler-window", str(a.window)]
    rc, summary, err, events = _job(tmp, flags, train(a.steps), nodes=3, spares=0)
    if summary is None:
        return {"variant": name, "error": _error(rc, err)}
    said = select(read_events(events), "straggler")
    return {
        "variant": name,
        "step_ms": _ms(summary["job"].get("step_s")),
        "false_stragglers": len(said),
        "max_false_slowdown": max((float(e.get("slowdown", 0.0)) for e in said), default=None),
    }


def _rate(samples: list[tuple[float, int]], t0: float | None, t1: float | None) -> float | None:
    """Steps per second between the first and last committed-step samples in [t0, t1]."""
    if t0 is None or t1 is None:
        return None
    inside = [(t, s) for t, s in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 3)


def phases(events: list[dict[str, Any]], node: str = SLOW_NODE) -> dict[str, Any]:
    """Pure: before / during / after the slowdown, from one job's events (controller clock)."""

    def t(e: dict[str, Any] | None) -> float | None:
        return float(e["t_mono"]) if e is not None else None

    full = [e for e in events if e["event"] == "full_strength_step"]
    samples = sorted(
        (float(e["t_mono"]), int(e["step"]))
        for e in events
        if e["event"] in ("progress", "full_strength_step") and isinstance(e.get("step"), int)
    )
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    t_fault = t(fault)
    said = [e for e in events if e["event"] == "straggler" and e.get("node") == node]
    if t_fault is not None:
        said = [e for e in said if float(e["t_mono"]) >= t_fault]
    detected = said[0] if said else None
    replaced = next((e for e in said if e.get("replaced")), None)
    t_replaced = t(replaced)
    back = next((e for e in full if t_replaced is not None and float(e["t_mono"]) >= t_replaced), None)
    end = next((e for e in events if e["event"] in ("job_finished", "job_failed")), None)
    t_end = t(end) if end is not None else (samples[-1][0] if samples else None)
    t_start = t(full[0]) if full else None
    t_back = t(back)
    before = _rate(samples, t_start, t_fault)
    after = _rate(samples, t(back), t_end) if back is not None else None
    return {
        "fault_step": fault.get("step") if fault is not None else None,
        "before_sps": before,
        "during_sps": _rate(samples, t_fault, t_replaced if replaced is not None else t_end),
        "after_sps": after,
        "detect_s": round(float(detected["t_mono"]) - t_fault, 3) if detected and t_fault is not None else None,
        "detect_slowdown": detected.get("slowdown") if detected else None,
        "replaced": replaced is not None,
        "replaced_node": next((e.get("node") for e in events if e["event"] == "straggler" and e.get("replaced")), None),
        "replaced_at_step": next(
            (e.get("committed_step") for e in events if e["event"] == "failure_detected" and e.get("node") == node),
            None,
        )
        if replaced is not None
        else None,
        "replace_s": round(t_back - t_replaced, 3) if t_back is not None and t_replaced is not None else None,
        "regained": round(after / before, 3) if after and before else None,
    }


def slow_run(name: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    flags = [
        *SLOW[name],
        "--straggler-threshold", str(a.threshold),
        "--straggler-window", str(a.window),
        "--inject", f"slow:{SLOW_NODE.removeprefix('local-')}@{a.slow_at}+{SLOW_PCT}%",
    ]  # fmt: skip
    worker_cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--batch", str(a.batch)]
    rc, summary, err, events = _job(tmp, flags, train(a.slow_steps, script=worker_cmd, python=None), nodes=4, spares=1)
    if summary is None:
        return {"variant": name, "error": _error(rc, err)}
    evs = read_events(events)
    train_s = summary["job"].get("train_s")
    out = {"variant": name, "train_s": round(train_s, 3) if isinstance(train_s, (int, float)) else None, **phases(evs)}
    return out


# ---- summary ----------------------------------------------------------------------------
def _med(runs: list[dict[str, Any]], name: str, key: str) -> Any:
    xs = [r[key] for r in runs if r["variant"] == name and isinstance(r.get(key), (int, float))]
    return round(statistics.median(xs), 3) if xs else None


def summarize(overhead: list[dict[str, Any]], slow: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    on, off = _med(overhead, "on", "step_ms"), _med(overhead, "off", "step_ms")
    pace: dict[str, Any] = {
        "job": f"--nodes 3 --spares 0, examples/train.py --steps {a.steps}",
        "on_step_ms": on,
        "off_step_ms": off,
        "ratio": round(on / off, 4) if on and off else None,
        "on_runs_ms": [r["step_ms"] for r in overhead if r["variant"] == "on" and r.get("step_ms")],
        "off_runs_ms": [r["step_ms"] for r in overhead if r["variant"] == "off" and r.get("step_ms")],
        "false_stragglers": sum(r.get("false_stragglers", 0) for r in overhead if r["variant"] == "on"),
        "max_false_slowdown": max(
            (r["max_false_slowdown"] for r in overhead if r.get("max_false_slowdown") is not None), default=None
        ),
    }
    keys = ("train_s", "before_sps", "during_sps", "after_sps", "detect_s", "replace_s", "regained")
    slowed: dict[str, Any] = {
        "job": (
            f"--nodes 4 --spares 1, bench/stragglers.py worker --batch {a.batch} --steps {a.slow_steps}, "
            f"--inject slow:node1@{a.slow_at}+{SLOW_PCT}%"
        ),
        "threshold": a.threshold,
        "window": a.window,
    }
    for name in SLOW:
        mine = [r for r in slow if r["variant"] == name]
        slowed[name] = {k: _med(slow, name, k) for k in keys}
        slowed[name]["replaced"] = f"{sum(bool(r.get('replaced')) for r in mine)}/{len(mine)}"
        slowed[name]["replaced_other"] = sum(r.get("replaced_node") not in (None, SLOW_NODE) for r in mine)
    rep, kept = slowed["replace"]["train_s"], slowed["report"]["train_s"]
    slowed["train_ratio"] = round(rep / kept, 3) if rep and kept else None  # replace / report
    return {"pace_overhead": pace, "slow_node": slowed}


def _rounds(names: list[str], runs: int, run: Any, a: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(runs):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotated: no variant always first
        for name in order:
            with tempfile.TemporaryDirectory(prefix="resild-bench-stragglers-") as d:
                r = run(name, a, Path(d))
            out.append(r)
            print(f"{label} round {i + 1} {name}: {r}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=2, help="rounds (each runs every variant of both measurements once)")
    p.add_argument("--steps", type=int, default=400, help="steps per pace-overhead job")
    p.add_argument("--slow-steps", type=int, default=800, help="steps per slow-node job")
    p.add_argument(
        "--slow-at", type=int, default=30, help="the step the node turns slow at (before any window is full)"
    )
    p.add_argument("--batch", type=int, default=512, help="the slow-node job's per-rank batch")
    p.add_argument("--threshold", type=float, default=0.25, help="--straggler-threshold")
    p.add_argument("--window", type=int, default=30, help="--straggler-window")
    p.add_argument("--quick", action="store_true", help="tiny jobs, one round: the output's shape only")
    p.add_argument("--json", action="store_true", help="one JSON object: every run and the summary")
    a = p.parse_args(argv)
    if a.quick:
        a.runs, a.steps, a.slow_steps, a.slow_at, a.batch, a.window = 1, 30, 40, 10, 32, 5
    if a.runs < 1 or a.steps < 10 or a.batch < 1 or not 2 <= a.window or not 0 < a.threshold <= 10:
        p.error("--runs and --batch must be >= 1, --steps >= 10, --window >= 2, --threshold in (0, 10]")
    if not 5 < a.slow_at < a.slow_steps:
        p.error("--slow-at must be past the first 5 steps and before --slow-steps")
    overhead = _rounds(list(OVERHEAD), a.runs, overhead_run, a, "pace")
    slow = _rounds(list(SLOW), a.runs, slow_run, a, "slow")
    summary = summarize(overhead, slow, a)
    if a.json:
        print(json.dumps({"runs": {"pace_overhead": overhead, "slow_node": slow}, "summary": summary}, indent=2))
        return 0
    s, w = summary["pace_overhead"], summary["slow_node"]
    print(f"pace overhead ({s['job']}): step_ms on {s['on_step_ms']} off {s['off_step_ms']} ratio {s['ratio']}")
    print(f"  runs on {s['on_runs_ms']} off {s['off_runs_ms']}")
    print(f"  false stragglers with pace on: {s['false_stragglers']} (largest slowdown {s['max_false_slowdown']})")
    print(f"slow node ({w['job']}; --straggler-threshold {w['threshold']} --straggler-window {w['window']})")
    cols: tuple[str, ...] = ("train_s", "before_sps", "during_sps", "after_sps", "detect_s", "replace_s", "regained")
    cols += ("replaced", "replaced_other")
    print(f"{'':<9}" + "".join(f"{c:>12}" for c in cols))
    for name in SLOW:
        print(f"{name:<9}" + "".join(f"{'-' if w[name][c] is None else w[name][c]:>12}" for c in cols))
    print(f"train_s replace / report: {w['train_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
