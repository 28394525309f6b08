"""Baseline recovery benchmark: `torchrun --max-restarts` plus a disk checkpoint.

Runs ``bench/baseline_train.py`` under torchrun, SIGKILLs one worker once, and
measures from the workers' event log how long the job took to get back to training:

    fault ──detect──▶ restarted workers start ──restart──▶ all ready ──first_step──▶ first step committed
    └──────────────────────────────── total ───────────────────────────────────────┘

- ``detect_s``: fault → first ``start`` event of the restarted attempt (torchrun noticed
  the exit, stopped the survivors, re-rendezvoused and spawned new processes; includes
  the interpreter start-up up to the script's first line).
- ``restart_s``: that start → the last rank ``ready`` (import torch, init the gloo group,
  build model + Adam, load the checkpoint, wrap in DDP).
- ``first_step_s``: last ready → the first step after the restart committed by every rank.
- ``total_s``: fault → that first step; the sum of the three above.
- ``steps_redone``: ``kill_at - resumed_step`` (committed work thrown away).
- ``caught_up_s``: fault → step ``kill_at`` (the one in flight at the fault) committed by
  every rank after the restart; what the failure cost this run in wall time is about
  ``caught_up_s - step_time_s``.
- ``step_time_s``: median interval between rank 0's failure-free steps.
- ``failed_restarts``: restarted attempts that never got every rank ready before the one
  that did (their time is inside ``restart_s``; the sub-phases ``import_s`` .. ``wrap_s``
  describe the attempt that recovered).

Usage::

    .venv/bin/python -m bench.torchrun_baseline --nproc 4 --steps 200 --kill-at 100 --ckpt-every 50
    .venv/bin/python -m bench.torchrun_baseline --runs 3 --json

Nothing here asserts on timings: it reports what it measured.
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
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import torchrun
from bench.common import PHASES, median, phase_table, read_events, select, step_intervals

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "baseline_train.py"

#: sub-phases of restart_s, from the ready event's wall times (median over ranks)
RESTART_PARTS = (
    ("import_s", "t_start", "t_torch_imported"),  # interpreter + import torch (+ examples.train)
    ("group_s", "t_torch_imported", "t_group_ready"),  # init_process_group (gloo rendezvous)
    ("build_s", "t_group_ready", "t_model_built"),  # model + Adam + StepLR
    ("load_s", "t_model_built", "t_ckpt_loaded"),  # torch.load + load_state_dict
    ("wrap_s", "t_ckpt_loaded", "t_wrapped"),  # DDP constructor (param broadcast)
)


def build_command(
    nproc: int,
    steps: int,
    kill_at: int,
    ckpt_every: int,
    events: Path,
    ckpt: Path,
    kill_rank: int = 1,
    max_restarts: int = 3,
    grad_sync: str = "ddp",
    python: str = sys.executable,
) -> list[str]:
    return torchrun(
        str(WORKER),
        "--steps",
        str(steps),
        "--ckpt",
        str(ckpt),
        "--ckpt-every",
        str(ckpt_every),
        "--kill-at",
        str(kill_at),
        "--kill-rank",
        str(kill_rank),
        "--events",
        str(events),
        "--grad-sync",
        grad_sync,
        nproc_per_node=nproc,
        max_restarts=max_restarts,
        monitor_interval=0.1,
        python=python,
    )


def _kill_leftovers(events: list[dict[str, Any]]) -> None:
    """SIGKILL worker processes of this run that are still alive (by pid, from their start events)."""
    for e in select(events, "start"):
        try:
            os.kill(int(e["pid"]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError, KeyError, ValueError):
            pass


def run_baseline(
    nproc: int,
    steps: int,
    kill_at: int,
    ckpt_every: int,
    workdir: Path,
    timeout_s: float = 300,
    *,
    kill_rank: int = 1,
    disable_shared_store: bool = True,
    grad_sync: str = "ddp",
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run one torchrun job with one injected SIGKILL and return its measured phases (seconds).

    ``workdir`` receives ``events.jsonl``, ``ckpt.pt`` and ``torchrun.log`` (earlier ones
    are removed first). ``disable_shared_store=False`` leaves
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset, torch's default.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    events_path, ckpt, log_path = workdir / "events.jsonl", workdir / "ckpt.pt", workdir / "torchrun.log"
    for p in [events_path, ckpt, log_path, *workdir.glob("ckpt.pt.tmp.*")]:
        p.unlink(missing_ok=True)

    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if disable_shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = build_command(
        nproc, steps, kill_at, ckpt_every, events_path, ckpt, kill_rank=kill_rank, grad_sync=grad_sync, python=python
    )

    t_launch = time.time()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            exit_code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
            try:
                exit_code = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                exit_code = proc.wait()
            _kill_leftovers(read_events(events_path))
    t_end = time.time()

    res = analyze(read_events(events_path), nproc=nproc, kill_at=kill_at)
    res.update(
        nproc=nproc,
        steps=steps,
        kill_at=kill_at,
        ckpt_every=ckpt_every,
        kill_rank=kill_rank,
        grad_sync=grad_sync,
        shared_store_disabled=disable_shared_store,
        exit_code=exit_code,
        timed_out=timed_out,
        wall_s=t_end - t_launch,
        workdir=str(workdir),
        log=str(log_path),
        command=cmd,
    )
    return res


def analyze(events: list[dict[str, Any]], nproc: int, kill_at: int) -> dict[str, Any]:
    """Phases from one run's events. Fields that could not be measured are None."""
    res: dict[str, Any] = dict.fromkeys(PHASES)
    res.update(
        steps_redone=None,
        resumed_step=None,
        failed_restarts=None,
        caught_up_s=None,
        step_time_s=None,
        cold_start_s=None,
        ckpt_save_s=None,
        restarts=max((e.get("restart_count", 0) for e in events), default=0),
        completed=len(select(events, "done")) == nproc,
    )
    res.update({name: None for name, _, _ in RESTART_PARTS})

    # cold start of the first attempt: first process start → every rank ready
    s0, r0 = select(events, "start", restart_count=0), select(events, "ready", restart_count=0)
    if s0 and len(r0) == nproc:
        res["cold_start_s"] = max(e["t_wall"] for e in r0) - min(e["t_wall"] for e in s0)
    saves = [e["save_s"] for e in select(events, "ckpt")]
    res["ckpt_save_s"] = median(saves)

    # failure-free step time: rank 0, first attempt before the fault and any later attempt
    # after its first step
    faults = select(events, "fault_injected")
    last0 = kill_at - 1 if faults else None
    iv = step_intervals(events, rank=0, restart_count=0, last=last0)
    for rc in sorted({e.get("restart_count", 0) for e in events} - {0}):
        iv += step_intervals(events, rank=0, restart_count=rc)
    res["step_time_s"] = median(iv)

    if not faults:
        return res
    fault = faults[0]
    t_f, rc_fault = fault["t_wall"], fault.get("restart_count", 0)
    first_starts = select(events, "start", restart_count=rc_fault + 1)
    if not first_starts:
        return res
    t_start = min(e["t_wall"] for e in first_starts)
    res["detect_s"] = t_start - t_f
    # The attempt that recovered: the first one after the fault in which every rank got
    # ready. Attempts in between failed (e.g. stale addresses in a shared rendezvous
    # store); their time is part of restart_s and they are counted in failed_restarts.
    attempts = sorted({e.get("restart_count", 0) for e in events if e.get("restart_count", 0) > rc_fault})
    rc = next((a for a in attempts if len(select(events, "ready", restart_count=a)) >= nproc), None)
    if rc is None:
        res["failed_restarts"] = len(attempts)
        return res
    res["failed_restarts"] = rc - rc_fault - 1
    starts = select(events, "start", restart_count=rc)
    readies = select(events, "ready", restart_count=rc)
    t_ready = max(e["t_wall"] for e in readies)
    res["restart_s"] = t_ready - t_start
    resumed = {e["resumed_step"] for e in readies}
    res["resumed_step"] = min(resumed)
    if len(resumed) > 1:
        res["resumed_step_disagreement"] = sorted(resumed)
    res["steps_redone"] = kill_at - res["resumed_step"]

    start_by_pid = {e["pid"]: e["t_wall"] for e in starts}
    for name, a, b in RESTART_PARTS:
        vals = []
        for e in readies:
            ta = start_by_pid.get(e["pid"]) if a == "t_start" else e.get(a)
            tb = e.get(b)
            if ta is not None and tb is not None:
                vals.append(tb - ta)
        res[name] = median(vals)

    first = select(events, "step", restart_count=rc, step=res["resumed_step"])
    if len(first) == nproc:
        t_first = max(e["t_wall"] for e in first)
        res["first_step_s"] = t_first - t_ready
        res["total_s"] = t_first - t_f
    back = select(events, "step", restart_count=rc, step=kill_at)
    if len(back) == nproc:
        res["caught_up_s"] = max(e["t_wall"] for e in back) - t_f
    return res


SUMMARY_COLUMNS = (*PHASES, "steps_redone", "caught_up_s", "step_time_s", "exit_code")
DETAIL_COLUMNS = (
    "import_s",
    "group_s",
    "build_s",
    "load_s",
    "wrap_s",
    "cold_start_s",
    "ckpt_save_s",
    "restarts",
    "failed_restarts",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="torchrun --max-restarts + disk checkpoint: recovery phases")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--runs", type=int, default=1, help="repeat the run this many times, one after another")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--grad-sync", choices=("ddp", "allreduce"), default="ddp")
    p.add_argument(
        "--shared-store", action="store_true", help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset (torch's default)"
    )
    p.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON object per run instead of a table")
    args = p.parse_args(argv)

    base = args.workdir or Path(tempfile.mkdtemp(prefix="resild-baseline-"))
    results = []
    for i in range(args.runs):
        wd = base / f"run{i + 1}" if args.runs > 1 else base
        r = run_baseline(
            args.nproc,
            args.steps,
            args.kill_at,
            args.ckpt_every,
            wd,
            args.timeout,
            kill_rank=args.kill_rank,
            disable_shared_store=not args.shared_store,
            grad_sync=args.grad_sync,
        )
        r["run"] = i + 1
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
    if not args.json:
        print(
            f"torchrun --max-restarts 3, {args.nproc} ranks, gloo, {args.grad_sync}, ckpt every "
            f"{args.ckpt_every}, SIGKILL rank {args.kill_rank} at step {args.kill_at}; seconds"
        )
        print(phase_table(results, SUMMARY_COLUMNS))
        print()
        print("restart_s parts (median over ranks) and other costs:")
        print(phase_table(results, DETAIL_COLUMNS))
        print(f"\nevents and logs under {base}")
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
