"""Recovery benchmark: resild (checkpointless, hot spare) vs torchrun (restart + disk checkpoint).

One invocation runs both sides on the same model and data (``examples/train.py``: ~0.9M
parameters, Adam + StepLR, gloo on CPU, one intra-op thread per rank), the same number of
ranks and the same fault: SIGKILL of one worker (resild: worker 0 of ``local-node1``,
i.e. global rank ``nproc_per_node``; torchrun: the same global rank) once the job has
committed ``--kill-at`` steps. With ``--runs N`` the two sides alternate
(resild, torchrun, torchrun, resild, ...) so neither always runs on a warmer machine.

resild side::

    python -m launcher.run.cli --local --nodes NPROC/PPN+1 --spares 1 --nproc-per-node PPN \\
        --events FILE --json --inject kill:node1@KILL_AT -- python examples/train.py --steps STEPS

Its phases, from the event file (``t_mono`` is CLOCK_MONOTONIC, comparable across the
controller and worker processes of one machine):

    fault ─detect─▶ failure_detected ─fence─▶ node_fenced ─announce─▶ spare_assigned
          ─notify─▶ rank 0 starts recovering ─recover─▶ resumed ─first_step─▶ full_strength_step
    └──────────────────────────────────── total ─────────────────────────────────────────┘

- ``detect_s``:  fault_injected → failure_detected (the controller decides to inject,
  the node SIGKILLs its worker, its pidfd wakes it, WORKER_EXIT reaches the controller).
- ``fence_s``:   failure_detected → node_fenced (killpg of the failed node).
- ``announce_s``: node_fenced → spare_assigned (the controller's decision; the new
  epoch's MEMBERSHIP messages go out right after it).
- ``notify_s``:  spare_assigned → rank 0 begins re-forming (membership delivery, abandoning
  the collective in flight). The ``membership`` event itself is written *after* the
  messages are sent, so rank 0 can be re-forming before it is logged; it is not used as a
  phase boundary.
- ``recover_s``: rank 0's ``resumed.seconds``: re-form + agree on the committed step +
  send the state; of which
  ``reform_s`` (``group_reformed.seconds``: new gloo group) and
  ``replay_s`` / ``replay_mb`` (``state_replayed``: slowest receiving rank's seconds, bytes
  summed over receivers).
- ``first_step_s``: resumed → full_strength_step (the first step committed by the whole
  new group; includes the receivers' tail of restoring the replayed state, shown as
  ``replay_tail_s`` = resumed → last state_replayed).
- ``total_s``: fault_injected → full_strength_step; detect+fence+announce+notify+recover+
  first_step add up to it.
- ``steps_redone``: committed steps lost (failure's committed step − resumed step);
  checkpointless recovery should make this 0.
- ``caught_up_s``: fault → the step in flight at the fault committed at full strength
  (= ``total_s`` when nothing was lost; otherwise estimated as total + lost × step time).
- ``step_time_s``, ``goodput``: from resil-run's ``--json`` summary
  (goodput = steps × median step / training wall time).
- ``cold_start_s``: job_started → first membership (spawn, import torch, build, register).

torchrun side: ``bench.torchrun_baseline.run_baseline`` (``torchrun --max-restarts 3`` +
a disk checkpoint every ``--ckpt-every`` steps), its phases ``detect_s``, ``restart_s``,
``first_step_s``, ``total_s``, ``steps_redone``, ``caught_up_s``, ``step_time_s`` (see that
module), plus a goodput computed here from its event log with resild's formula.

Comparison: ``speedup_total`` = torchrun total_s / resild total_s, ``speedup_caught_up`` =
torchrun caught_up_s / resild caught_up_s (this one charges the steps torchrun redoes).
Target: resild fault → full-strength committed step within 1 s + one step time, and at
least 20× faster than the torchrun restart (``speedup_total``); the script prints whether
each run met it, as a measured fact. Nothing here asserts on timings.

``--fault hang`` (optional variant): resild SIGSTOPs the worker instead and finds it with
its hang detector (``--hang-timeout``, default here 2 s). torchrun has no hang detection
besides the gloo collective timeout (``bench/baseline_train.py --pg-timeout``, 60 s), so its
hang is not run: the torchrun kill run is measured as usual and the torchrun hang total is
*estimated* as that timeout + the measured kill-recovery total (a lower bound, labelled
``est``).

Usage::

    .venv/bin/python -m bench.recovery                       # 4 ranks, 200 steps, kill at 130, ckpt every 50
    .venv/bin/python -m bench.recovery --runs 3              # alternate the two sides, medians at the end
    .venv/bin/python -m bench.recovery --json                # one JSON object per run, then a summary object
    .venv/bin/python -m bench.recovery --fault hang --hang-timeout 2
    .venv/bin/python -m bench.recovery --only resild         # skip one side (or --only torchrun)

On a 2-core machine the default (one run of each side) takes about 45 s, more when it is busy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import resil_run, train
from bench.common import median, phase_table, read_events, select
from bench.torchrun_baseline import run_baseline

REPO = Path(__file__).resolve().parent.parent
#: gloo collective timeout of bench/baseline_train.py (its --pg-timeout default): the only
#: thing that ends a hang under torchrun
TORCHRUN_HANG_TIMEOUT_S = 60.0
TARGET_SPEEDUP = 20.0
TARGET_BASE_S = 1.0

RESILD_PHASES = (
    "detect_s",
    "fence_s",
    "reform_s",
    "replay_s",
    "replay_mb",
    "first_step_s",
    "total_s",
    "steps_redone",
    "caught_up_s",
    "step_time_s",
    "goodput",
    "exit_code",
)
RESILD_PARTS = (
    "detect_s",
    "fence_s",
    "announce_s",
    "notify_s",
    "recover_s",
    "first_step_s",
    "total_s",
    "replay_tail_s",
    "cold_start_s",
    "wall_s",
)
TORCHRUN_PHASES = (
    "detect_s",
    "restart_s",
    "first_step_s",
    "total_s",
    "steps_redone",
    "caught_up_s",
    "step_time_s",
    "goodput",
    "exit_code",
)
COMPARE = ("speedup_total", "speedup_caught_up", "target_s", "within_target_s", "speedup_ge_20x", "target_met")


# ---- resild side ------------------------------------------------------------
def resild_command(
    nproc: int,
    ppn: int,
    steps: int,
    kill_at: int,
    events: Path,
    fault: str = "kill",
    hang_timeout_s: float | None = None,
    spares: int = 1,
    python: str = sys.executable,
) -> tuple[list[str], str]:
    """The resil-run command and the name of the node whose worker 0 gets the fault."""
    if nproc % ppn:
        raise ValueError(f"--nproc {nproc} is not a multiple of --nproc-per-node {ppn}")
    active = nproc // ppn
    node = "node1" if active >= 2 else "node0"
    options = ["--events", str(events), "--json", "--inject", f"{fault}:{node}@{kill_at}"]
    if hang_timeout_s is not None:
        options += ["--hang-timeout", str(hang_timeout_s)]
    worker = train(steps, python=python)
    cmd = resil_run(*options, nodes=active + spares, spares=spares, nproc_per_node=ppn, worker=worker, python=python)
    return cmd, f"local-{node}"


def _parse_summary(stdout: str) -> dict[str, Any] | None:
    """resil-run --json prints one indented object; anything a worker printed may surround it."""
    try:
        obj = json.loads(stdout)
        return obj if isinstance(obj, dict) else None
    except ValueError:
        pass
    i = stdout.rfind('{\n  "exit_code"')
    if i < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(stdout[i:])
        return cast(dict[str, Any], obj)
    except ValueError:
        return None


def run_resild(
    nproc: int,
    ppn: int,
    steps: int,
    kill_at: int,
    workdir: Path,
    timeout_s: float = 300,
    *,
    fault: str = "kill",
    hang_timeout_s: float | None = None,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one resil-run job with one injected fault; return its measured phases (seconds).
    ``env``: added to the job's environment.

    ``workdir`` receives ``events.jsonl``, ``resil-run.log`` (stderr) and ``summary.json``
    (resil-run's --json output); the run directory (keys, journal) is ``workdir/run``.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    events_path, log_path, summary_path = workdir / "events.jsonl", workdir / "resil-run.log", workdir / "summary.json"
    for p in (events_path, log_path, summary_path):
        p.unlink(missing_ok=True)
    cmd, node = resild_command(nproc, ppn, steps, kill_at, events_path, fault, hang_timeout_s, python=python)
    cmd[cmd.index("--events") : cmd.index("--events")] = ["--run-dir", str(workdir / "run")]
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")

    t_launch = time.time()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)  # resil-run shuts its cluster down on Ctrl-C
            try:
                out, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # node processes die with their parent (PDEATHSIG)
                out, _ = proc.communicate()
    t_end = time.time()
    stdout = out.decode(errors="replace")
    summary = _parse_summary(stdout)
    summary_path.write_text(json.dumps(summary, indent=2) if summary is not None else stdout)

    res = analyze_resild(read_events(events_path), summary, fault_node=node)
    res.update(
        nproc=nproc,
        nproc_per_node=ppn,
        steps=steps,
        kill_at=kill_at,
        fault=fault,
        hang_timeout_s=hang_timeout_s,
        exit_code=proc.returncode,
        timed_out=timed_out,
        wall_s=t_end - t_launch,
        workdir=str(workdir),
        log=str(log_path),
        command=cmd,
    )
    return res


def analyze_resild(events: list[dict[str, Any]], summary: dict[str, Any] | None, fault_node: str) -> dict[str, Any]:
    """Phases of the first injected failure. Fields that could not be measured are None."""
    keys = set(RESILD_PHASES) | set(RESILD_PARTS)
    res: dict[str, Any] = dict.fromkeys(keys)
    res.update(
        killed_rank=None,
        replay_bytes=None,
        detector=None,
        cause=None,
        committed_step=None,
        resumed_step=None,
        fault_step=None,
        epoch=None,
    )
    job = (summary or {}).get("job") or {}
    res["step_time_s"] = job.get("step_s")
    res["goodput"] = job.get("goodput")
    res["steps_completed"] = job.get("steps")

    started = select(events, "job_started")
    m1 = select(events, "membership", epoch=1)
    if started and m1:
        res["cold_start_s"] = m1[0]["t_mono"] - started[0]["t_mono"]
        ranks = (m1[0].get("layout") or {}).get(fault_node)
        if ranks:
            res["killed_rank"] = ranks[0]  # the fault hits worker (local rank) 0 of the node

    faults = select(events, "fault_injected", node=fault_node)
    if not faults:
        return res
    f = faults[0]
    t_f = f["t_mono"]
    res["fault_step"] = f.get("step")
    after = [e for e in events if e["t_mono"] >= t_f]
    det = next((e for e in after if e["event"] == "failure_detected" and e.get("node") == fault_node), None)
    if det is None:
        return res
    res.update(
        detect_s=det["t_mono"] - t_f,
        detector=det.get("detector"),
        cause=det.get("cause"),
        committed_step=det.get("committed_step"),
    )
    fenced = next((e for e in after if e["event"] == "node_fenced" and e.get("node") == fault_node), None)
    if fenced is not None:
        res["fence_s"] = fenced["t_mono"] - det["t_mono"]
    assigned = next((e for e in after if e["event"] == "spare_assigned" and e.get("failed") == fault_node), None)
    if assigned is None:
        return res
    ep = assigned["epoch"]
    res["epoch"] = ep
    if fenced is not None:
        res["announce_s"] = assigned["t_mono"] - fenced["t_mono"]
    reformed = next((e for e in after if e["event"] == "group_reformed" and e.get("epoch") == ep), None)
    if reformed is not None:
        res["reform_s"] = float(reformed["seconds"])
    replayed = [e for e in after if e["event"] == "state_replayed" and e.get("epoch") == ep]
    if replayed:
        res["replay_s"] = max(float(e["seconds"]) for e in replayed)
        res["replay_bytes"] = sum(int(e["bytes"]) for e in replayed)
        res["replay_mb"] = res["replay_bytes"] / 1e6
    resumed = next((e for e in after if e["event"] == "resumed" and e.get("epoch") == ep), None)
    if resumed is not None:
        res["recover_s"] = float(resumed["seconds"])
        res["resumed_step"] = resumed.get("step")
        res["notify_s"] = (resumed["t_mono"] - res["recover_s"]) - assigned["t_mono"]
        if replayed:
            res["replay_tail_s"] = max(e["t_mono"] for e in replayed) - resumed["t_mono"]
        if det.get("committed_step") is not None and resumed.get("step") is not None:
            res["steps_redone"] = int(det["committed_step"]) - int(resumed["step"])
    # resild's own report matches full_strength_step to any epoch >= the spare's epoch
    full = next((e for e in after if e["event"] == "full_strength_step" and e.get("epoch", 0) >= ep), None)
    if full is not None:
        res["total_s"] = full["t_mono"] - t_f
        res["full_strength_step"] = full.get("step")
        if resumed is not None:
            res["first_step_s"] = full["t_mono"] - resumed["t_mono"]
        lost = res["steps_redone"] or 0
        if lost == 0:
            res["caught_up_s"] = res["total_s"]
        elif res["step_time_s"] is not None:
            res["caught_up_s"] = res["total_s"] + lost * res["step_time_s"]
            res["caught_up_estimated"] = True
    return res


# ---- torchrun side ------------------------------------------------------------
def torchrun_goodput(events: list[dict[str, Any]], steps: int, step_time_s: float | None) -> float | None:
    """resild's formula on the baseline's log: (steps-1) × median step / (rank 0's first step → last step)."""
    if step_time_s is None:
        return None
    s = select(events, "step", rank=0)
    first = [e["t_wall"] for e in s if e.get("restart_count", 0) == 0 and e["step"] == 0]
    last = [e["t_wall"] for e in s if e["step"] == steps - 1]
    if not first or not last:
        return None
    train_s = max(last) - min(first)
    return min(1.0, (steps - 1) * step_time_s / train_s) if train_s > 0 else None


def run_torchrun(
    nproc: int, steps: int, kill_at: int, ckpt_every: int, workdir: Path, timeout_s: float, kill_rank: int
) -> dict[str, Any]:
    r = run_baseline(nproc, steps, kill_at, ckpt_every, workdir, timeout_s, kill_rank=kill_rank)
    r["goodput"] = torchrun_goodput(read_events(Path(workdir) / "events.jsonl"), steps, r.get("step_time_s"))
    return r


# ---- comparison -------------------------------------------------------------
def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def compare(rs: dict[str, Any] | None, tr: dict[str, Any] | None, fault: str) -> dict[str, Any]:
    out: dict[str, Any] = dict.fromkeys(COMPARE)
    if rs is None:
        return out
    step = rs.get("step_time_s")
    total = rs.get("total_s")
    if step is not None:
        out["target_s"] = TARGET_BASE_S + step
        if total is not None:
            out["within_target_s"] = total <= out["target_s"]
    if tr is not None:
        t_total, t_caught = tr.get("total_s"), tr.get("caught_up_s")
        if fault == "hang":  # torchrun would first sit in the collective timeout (not measured)
            t_total = t_total + TORCHRUN_HANG_TIMEOUT_S if t_total is not None else None
            t_caught = t_caught + TORCHRUN_HANG_TIMEOUT_S if t_caught is not None else None
            out["torchrun_estimated"] = True
        out["speedup_total"] = _ratio(t_total, total)
        out["speedup_caught_up"] = _ratio(t_caught, rs.get("caught_up_s"))
        if out["speedup_total"] is not None:
            out["speedup_ge_20x"] = out["speedup_total"] >= TARGET_SPEEDUP
    if out["within_target_s"] is not None and out["speedup_ge_20x"] is not None:
        out["target_met"] = out["within_target_s"] and out["speedup_ge_20x"]
    return out


def _yn(v: object) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def _table(rows: list[dict[str, Any]], cols: tuple[str, ...], digits: int = 3) -> str:
    """phase_table, with booleans shown as yes/NO."""
    conv = [{k: (_yn(v) if isinstance(v, bool) else v) for k, v in r.items()} for r in rows]
    return phase_table(conv, cols, digits=digits)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Recovery after one SIGKILLed worker: resild vs torchrun --max-restarts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Usage::")[1],
    )
    p.add_argument("--nproc", type=int, default=4, help="ranks in the job (both sides)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="resild: ranks per simulated node (+1 spare node)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=130, help="the fault hits once this many steps are committed")
    p.add_argument("--ckpt-every", type=int, default=50, help="torchrun: disk checkpoint every N steps")
    p.add_argument("--runs", type=int, default=1, help="pairs of runs; the order alternates")
    p.add_argument(
        "--fault",
        choices=("kill", "hang"),
        default="kill",
        help="resild fault; torchrun always gets the kill (see the module doc for hang)",
    )
    p.add_argument("--hang-timeout", type=float, default=2.0, help="resild --hang-timeout with --fault hang")
    p.add_argument("--only", choices=("resild", "torchrun"), help="run only one side")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="one JSON object per run, then one summary object")
    args = p.parse_args(argv)
    if args.nproc % args.nproc_per_node:
        p.error(f"--nproc {args.nproc} must be a multiple of --nproc-per-node {args.nproc_per_node}")
    if not 0 < args.kill_at < args.steps:
        p.error("--kill-at must be inside (0, --steps)")

    active = args.nproc // args.nproc_per_node
    kill_rank = args.nproc_per_node * (1 if active >= 2 else 0)  # worker 0 of local-node1 (or node0)
    hang_timeout = args.hang_timeout if args.fault == "hang" else None
    base = args.workdir or Path(tempfile.mkdtemp(prefix="resild-recovery-"))
    sides = [s for s in ("resild", "torchrun") if args.only in (None, s)]

    results = []
    for i in range(args.runs):
        order = sides if i % 2 == 0 else sides[::-1]
        row: dict[str, Any] = {"run": i + 1, "order": order, "resild": None, "torchrun": None}
        for side in order:
            wd = base / f"run{i + 1}" / side
            if not args.json:
                print(f"run {i + 1}: {side} ...", file=sys.stderr, flush=True)
            if side == "resild":
                row["resild"] = run_resild(
                    args.nproc,
                    args.nproc_per_node,
                    args.steps,
                    args.kill_at,
                    wd,
                    args.timeout,
                    fault=args.fault,
                    hang_timeout_s=hang_timeout,
                )
            else:
                row["torchrun"] = run_torchrun(
                    args.nproc, args.steps, args.kill_at, args.ckpt_every, wd, args.timeout, kill_rank
                )
        if row["resild"] is not None and row["resild"].get("killed_rank") not in (None, kill_rank):
            row["note"] = f"resild killed rank {row['resild']['killed_rank']}, torchrun rank {kill_rank}"
        row.update(compare(row["resild"], row["torchrun"], args.fault))
        results.append(row)
        if args.json:
            print(json.dumps(row), flush=True)

    rs_rows = [dict(r["resild"], run=r["run"]) for r in results if r["resild"] is not None]
    tr_rows = [dict(r["torchrun"], run=r["run"]) for r in results if r["torchrun"] is not None]
    cmp_rows = [{k: r.get(k) for k in ("run", *COMPARE)} for r in results]

    def med(rows: list[dict[str, Any]], k: str) -> float | None:
        vals = [r.get(k) for r in rows if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool)]
        m = median(vals)
        return int(m) if m is not None and all(isinstance(v, int) for v in vals) and float(m).is_integer() else m

    summary = {
        "summary": True,
        "runs": args.runs,
        "fault": args.fault,
        "nproc": args.nproc,
        "steps": args.steps,
        "kill_at": args.kill_at,
        "ckpt_every": args.ckpt_every,
        "killed_rank": kill_rank,
        "workdir": str(base),
        "resild": {k: med(rs_rows, k) for k in (*RESILD_PHASES, *RESILD_PARTS) if k != "exit_code"},
        "torchrun": {k: med(tr_rows, k) for k in TORCHRUN_PHASES if k != "exit_code"},
        "runs_target_met": sum(1 for r in results if r.get("target_met")),
    }
    summary["speedup_total"] = (
        _ratio(summary["torchrun"]["total_s"], summary["resild"]["total_s"])
        if args.fault == "kill"
        else median([r.get("speedup_total") for r in results])
    )
    summary["speedup_caught_up"] = median([r.get("speedup_caught_up") for r in results])
    if args.json:
        print(json.dumps(summary), flush=True)
        return 0 if all(r.get("exit_code") == 0 for r in rs_rows + tr_rows) else 1

    fault_txt = "SIGKILL" if args.fault == "kill" else f"SIGSTOP (hang, resild --hang-timeout {args.hang_timeout:g})"
    print(
        f"\n{args.nproc} ranks, examples/train.py model (gloo, CPU), {fault_txt} of rank {kill_rank} once "
        f"{args.kill_at} of {args.steps} steps are committed; seconds"
    )
    if rs_rows:
        print(
            f"\nresild: {active} nodes x {args.nproc_per_node} + 1 hot spare node, checkpointless "
            f"(replay_mb: state sent to the spare's ranks)"
        )
        print(_table(rs_rows, RESILD_PHASES, digits=4))
        print(
            "\nresild total_s, adding up: detect + fence + announce (→spare_assigned) + notify (→rank 0 re-forming)"
            " + recover (rank 0: re-form, agree, send) + first_step"
        )
        print(_table(rs_rows, RESILD_PARTS, digits=4))
        for r in rs_rows:
            if r.get("cause"):
                print(
                    f"  run {r['run']}: {r['detector']}: {r['cause']} (committed step {r['committed_step']}, "
                    f"resumed at {r['resumed_step']})"
                )
    if tr_rows:
        print(
            f"\ntorchrun --max-restarts 3, --nproc-per-node {args.nproc}, DDP, disk checkpoint every "
            f"{args.ckpt_every} steps (SIGKILL)"
        )
        print(_table(tr_rows, TORCHRUN_PHASES))
    if rs_rows and tr_rows:
        est = (
            " (torchrun side estimated: +%gs collective timeout on the measured kill recovery)"
            % TORCHRUN_HANG_TIMEOUT_S
            if args.fault == "hang"
            else ""
        )
        print(f"\ncomparison{est}: speedup = torchrun / resild")
        print(_table(cmp_rows, COMPARE, digits=2))
        s = summary
        rs_m, tr_m = s["resild"], s["torchrun"]
        tr_total = tr_m["total_s"]
        tr_txt = "-" if tr_total is None else f"{tr_total:.3f}s"
        if args.fault == "hang" and tr_total is not None:
            tr_txt = f"est. {tr_total + TORCHRUN_HANG_TIMEOUT_S:.3f}s ({TORCHRUN_HANG_TIMEOUT_S:g}s timeout + {tr_total:.3f}s)"

        def f(v: object, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)

        print(
            f"\nmedians: resild total {f(rs_m['total_s'], '.3f')}s (step {f(rs_m['step_time_s'] and rs_m['step_time_s'] * 1000, '.1f')}ms), "
            f"torchrun total {tr_txt}: {f(s['speedup_total'], '.1f')}x faster; caught up (incl. redone steps) "
            f"{f(s['speedup_caught_up'], '.1f')}x; steps redone: resild {f(rs_m['steps_redone'], '')}, "
            f"torchrun {f(tr_m['steps_redone'], '')}; goodput: resild {f(rs_m['goodput'] and rs_m['goodput'] * 100, '.1f')}%, "
            f"torchrun {f(tr_m['goodput'] and tr_m['goodput'] * 100, '.1f')}%"
        )
        print(
            f"target (fault → full-strength committed step ≤ {TARGET_BASE_S:g}s + one step, and ≥{TARGET_SPEEDUP:g}x "
            f"faster than torchrun): met in {s['runs_target_met']} of {args.runs} run(s)"
        )
    elif rs_rows:
        n_ok = sum(1 for r in results if r.get("within_target_s"))
        print(
            f"\ntarget part 1 (fault → full-strength committed step ≤ {TARGET_BASE_S:g}s + one step): met in "
            f"{n_ok} of {args.runs} run(s); the ≥{TARGET_SPEEDUP:g}x part needs the torchrun side"
        )
    for r in results:
        if r.get("note"):
            print(f"note, run {r['run']}: {r['note']}")
    print(f"\nevents and logs under {base}")
    return 0 if all(r.get("exit_code") == 0 for r in rs_rows + tr_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
