"""What resild's control plane costs a training step on the cores it shares (issue 17).

One ``resil-run --local`` job of ``bench/sharded_train.py`` (DDP or HSDP, 2 nodes x 2
ranks, gloo on CPU). Once it is past its warm-up, the control plane's processes (the
embedded controller in ``resil-run`` and every node process) are paused with SIGSTOP and
resumed with SIGCONT in turns, each pause shorter than the heartbeat timeout, so the job
never notices; rank 0's step times (``--times``) are then split by the window each step
fell in. The trainers run the same code in both windows (their own link threads too):
the difference is what the controller and node processes cost them, from their CPU time
and from their wake-ups (each one preempts a trainer on a busy core). Printed with it,
per process and thread of the job: wake-ups per second and CPU, measured over a window
with nothing paused.

    python bench/control_plane_cost.py                    # DDP, a table (~1.5 min)
    python bench/control_plane_cost.py --model hsdp --rounds 12 --steps 600 --json

A window is ``--pause-s``; the controller is paused with the nodes and discounts time it
did not run, so a pause may come near the heartbeat timeout (2 s locally). Threads are
summed per process under their OS names (Python's own threads are all ``python``).
Nothing here asserts on timings: it reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sharded import _env, resild_cmd

CONTROL = ("launcher.run", "launcher.node")  # the control plane's processes, by module


@dataclass(frozen=True)
class Window:
    start: float  # time.perf_counter (CLOCK_MONOTONIC: the same clock as the trainers')
    end: float
    paused: bool


def split_steps(steps: list[list[float]], windows: list[Window], settle_s: float) -> dict[str, list[float]]:
    """Step times (``t_end[k] - t_end[k-1]``) of the steps that began (the previous step's
    end) at least `settle_s` into a window and ended inside it, by window kind."""
    out: dict[str, list[float]] = {"paused": [], "running": []}
    for prev, cur in zip(steps, steps[1:]):
        began, ended = prev[3], cur[3]
        for w in windows:
            if w.start + settle_s <= began and ended <= w.end:
                out["paused" if w.paused else "running"].append(ended - began)
                break
    return out


def _thread_counters(proc: psutil.Process) -> dict[int, tuple[str, int, int, float]]:
    """tid -> (name, voluntary, involuntary context switches, CPU seconds)."""
    out: dict[int, tuple[str, int, int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (
                (task / "comm").read_text().strip(),
                int(status["voluntary_ctxt_switches"]),
                int(status["nonvoluntary_ctxt_switches"]),
                (int(stat[11]) + int(stat[12])) / tick,
            )
        except (OSError, KeyError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return out


def _role(proc: psutil.Process) -> str:
    argv = " ".join(proc.cmdline()[:4])
    if "launcher.run" in argv:
        return "resil-run (controller)"
    if "launcher.node" in argv:
        return "node process"
    return "trainer"


def wakeups(procs: list[psutil.Process], window_s: float) -> list[dict[str, Any]]:
    """Per process role and thread name: wake-ups/s (voluntary switches) and CPU %."""
    before = {p.pid: _thread_counters(p) for p in procs}
    time.sleep(window_s)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for p in procs:
        try:
            after = _thread_counters(p)
            role = _role(p)
        except psutil.Error:
            continue
        for tid, (name, vol, invol, cpu) in after.items():
            b = before.get(p.pid, {}).get(tid)
            if b is None:
                continue
            r = rows.setdefault((role, name), {"role": role, "thread": name, "processes": set()})
            r["processes"].add(p.pid)
            r["wakeups_per_s"] = r.get("wakeups_per_s", 0.0) + (vol - b[1]) / window_s
            r["preempted_per_s"] = r.get("preempted_per_s", 0.0) + (invol - b[2]) / window_s
            r["cpu_pct"] = r.get("cpu_pct", 0.0) + (cpu - b[3]) / window_s * 100
    out = []
    for r in rows.values():
        n = len(r.pop("processes"))
        out.append(
            {**r, "per_process": n, **{k: round(r[k] / n, 1) for k in ("wakeups_per_s", "preempted_per_s", "cpu_pct")}}
        )
    return sorted(out, key=lambda r: (r["role"], -r["wakeups_per_s"]))


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="resild-cpcost-"))
    times, events = work / "times.json", work / "events.jsonl"
    cmd = resild_cmd(args.model, 4, 2, 0, args.steps, times, events, work / "run")
    log = open(work / "log.txt", "w")
    job = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    windows: list[Window] = []
    table: list[dict[str, Any]] = []
    control: list[psutil.Process] = []
    try:
        time.sleep(args.start_s)  # start-up and warm-up; steps before the windows are left out
        if job.poll() is not None:
            raise SystemExit(f"the job ended early (exit {job.returncode}); log: {work / 'log.txt'}")
        root = psutil.Process(job.pid)  # resil-run, with the embedded controller
        tree = [root, *(c for c in root.children(recursive=True) if c.name().startswith("python"))]
        control = [c for c in tree if any(m in " ".join(c.cmdline()[:4]) for m in CONTROL)]
        table = wakeups(tree, args.measure_s)
        print(
            f"control plane: {len(control)} processes; {args.rounds} rounds of {args.pause_s}s paused / running",
            file=sys.stderr,
        )
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            _signal_all(control, signal.SIGSTOP)
            time.sleep(args.pause_s)
            _signal_all(control, signal.SIGCONT)
            t1 = time.perf_counter()
            time.sleep(args.pause_s)
            windows += [Window(t0, t1, True), Window(t1, time.perf_counter(), False)]
        if job.poll() is not None:
            print("the job ended during the windows: give it more --steps", file=sys.stderr)
        rc = job.wait(args.timeout)
    finally:
        _signal_all(control, signal.SIGCONT)  # never leave a paused process behind
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    if rc != 0 or not times.exists():
        raise SystemExit(f"the job failed (exit {rc}); log: {work / 'log.txt'}")
    rec = json.loads(times.read_text())
    split = split_steps(rec["steps"], windows, args.settle_s)
    res: dict[str, Any] = {"model": args.model, "workdir": str(work), "threads": table}
    for kind, xs in split.items():
        res[f"{kind}_steps"] = len(xs)
        res[f"{kind}_step_ms"] = round(statistics.median(xs) * 1e3, 2) if xs else None
    if res["paused_step_ms"] and res["running_step_ms"]:
        res["running_over_paused"] = round(res["running_step_ms"] / res["paused_step_ms"], 3)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=("ddp", "hsdp"), default="ddp")
    p.add_argument("--rounds", type=int, default=8, help="paused + running windows")
    p.add_argument(
        "--pause-s",
        type=float,
        default=1.5,
        help="each window; the controller pauses too, so it may near the heartbeat timeout",
    )
    p.add_argument("--settle-s", type=float, default=0.3, help="steps starting this soon in a window are left out")
    p.add_argument("--start-s", type=float, default=25.0, help="after the launch, before measuring")
    p.add_argument("--measure-s", type=float, default=5.0, help="the wake-up window")
    p.add_argument("--steps", type=int, default=400, help="the job's; it must outlast the windows")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--workdir")
    p.add_argument("--json", action="store_true", help="one JSON object")
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        p.error("needs Linux (/proc, SIGSTOP of the job's processes)")
    if args.pause_s <= 0 or args.rounds < 1:
        p.error("--pause-s must be > 0 and --rounds >= 1")
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'role':24} {'thread':16} {'procs':>5} {'wakeups/s':>10} {'preempted/s':>12} {'cpu %':>6}")
    for r in res["threads"]:
        if r["wakeups_per_s"] >= 1 or r["cpu_pct"] >= 0.1:
            print(
                f"{r['role']:24} {r['thread']:16} {r['per_process']:5d} {r['wakeups_per_s']:10.1f} {r['preempted_per_s']:12.1f} {r['cpu_pct']:6.1f}"
            )
    print(
        f"\n{res['model']}: step {res['running_step_ms']} ms with the control plane running "
        f"({res['running_steps']} steps), {res['paused_step_ms']} ms paused ({res['paused_steps']}): "
        f"running / paused {res.get('running_over_paused')}"
    )
    print(f"times and logs under {res['workdir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
