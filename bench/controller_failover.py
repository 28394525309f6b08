"""Controller loss: how long until training continues at full strength, with and without standbys.

    python bench/controller_failover.py                 # 5 repeats of each side, a table
    python bench/controller_failover.py --repeats 3 --json

Each trial runs a real job on this machine (resil-run --local --nodes 3 --spares 1,
examples/train.py --steps 600) and takes its controller away once it has committed
--kill-at steps:

- standby (--controllers 3, etcd): SIGKILL the leader replica (pid from the first
  `controller_leader` event) at t_kill = time.monotonic(). From the event file
  (t_mono is CLOCK_MONOTONIC, comparable across processes on one host):
    takeover_s = new leader's `controller_leader`.t_mono - t_kill  (election + restore)
    full_s     = its first `full_strength_step`.t_mono - t_kill   (first committed step
                 the new leader sees from the whole group: the job is back)
  The job is then left to finish; its exit code is reported (0: nothing was lost).
- embedded (--controllers 1, the baseline): the controller lives inside resil-run, so
  "the controller cannot serve" is SIGSTOP of resil-run at t_stop. Without a standby the
  job is lost; measured is how fast it is cleaned up: lease_s = t_stop -> every node
  process (pids from `node_registered`) has exited (on its --controller-timeout lease).
  Then resil-run is SIGKILLed.

Target: full_s <= --heartbeat-timeout + 0.5 s (a controller loss costs no more than
noticing a lost node). Reported: median/min/max per side, the ratio median(full_s) /
target and pass/fail (on the median; max is shown). Both sides run with the same
--controller-timeout, interleaved (standby, embedded, standby, ...). Every process a
trial starts carries RESILD_TEST_MARK=<uuid> in its environment; whatever is left after a
trial is found by that mark (psutil) and killed. Progress goes to stderr.
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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make `bench` importable
    sys.path.insert(0, str(REPO))

from bench.commands import resil_run, train  # noqa: E402


def say(msg: str) -> None:
    print(f"[failover] {msg}", file=sys.stderr, flush=True)


class Job:
    """resil-run in the background, its event file and the mark on its process tree."""

    def __init__(self, d: Path, a: argparse.Namespace, controllers: int) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.mark, self.ev = uuid.uuid4().hex, d / "events.jsonl"
        cmd = resil_run(
            "--controllers",
            str(controllers),
            "--heartbeat-timeout",
            str(a.heartbeat_timeout),
            "--controller-timeout",
            str(a.controller_timeout),
            "--events",
            str(self.ev),
            "--run-dir",
            str(d / "run"),
            "--json",
            "-q",
            nodes=3,
            spares=1,
            worker=train(a.steps, d / "final.pt"),
        )
        self.err = open(d / "stderr.txt", "w")
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=self.err,
            env=dict(os.environ, RESILD_TEST_MARK=self.mark, PYTHONUNBUFFERED="1"),
        )

    def events(self) -> list[dict[str, Any]]:
        out = []
        if self.ev.exists():
            for line in self.ev.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # being written, or a writer killed mid-line
        return out

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if e := next((e for e in self.events() if pred(e)), None):
                return e
            if self.proc.poll() is not None:
                raise RuntimeError(f"resil-run exited ({self.proc.returncode}) before {what}")
            time.sleep(0.02)
        raise RuntimeError(f"no {what} within {timeout_s:.0f}s")

    def marked(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get("RESILD_TEST_MARK") == self.mark:
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return out

    def cleanup(self, grace_s: float = 5.0) -> int:
        """Kill resil-run if still there, then anything left with our mark; returns how many were left."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()
        deadline = time.monotonic() + grace_s  # die-with-parent and leases take a moment
        while (left := self.marked()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)
        if left:
            say(f"killed {len(left)} leftover process(es): {[p.pid for p in left]}")
        return len(left)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # nobody reaps: resil-run is stopped
    except psutil.NoSuchProcess:
        return True


def _at_step(a: argparse.Namespace) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "progress" and e.get("step", 0) >= a.kill_at


def standby_trial(d: Path, a: argparse.Namespace) -> dict[str, Any]:
    job = Job(d, a, controllers=3)
    try:
        first = job.wait(lambda e: e["event"] == "controller_leader", 120, "first controller_leader")
        at = job.wait(_at_step(a), 120, f"progress at step {a.kill_at}")
        os.kill(first["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        second = job.wait(
            lambda e: e["event"] == "controller_leader" and e["pid"] != first["pid"], 60, "a new controller_leader"
        )
        full = job.wait(
            lambda e: e["event"] == "full_strength_step" and e["t_mono"] >= second["t_mono"],
            60,
            "full_strength_step from the new leader",
        )
        try:
            rc: int | None = job.proc.wait(timeout=a.finish_timeout)
        except subprocess.TimeoutExpired:
            rc = None
        return {
            "takeover_s": second["t_mono"] - t_kill,
            "full_s": full["t_mono"] - t_kill,
            "killed_at_step": at["step"],
            "full_step": full["step"],
            "term": [first["term"], second["term"]],
            "restored": second["restored"],
            "rc": rc,
        }
    finally:
        job.cleanup()


def embedded_trial(d: Path, a: argparse.Namespace) -> dict[str, Any]:
    job = Job(d, a, controllers=1)
    try:
        at = job.wait(_at_step(a), 120, f"progress at step {a.kill_at}")
        pids = {int(e["pid"]) for e in job.events() if e["event"] == "node_registered" and e.get("pid")}
        job.proc.send_signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        while not all(_gone(p) for p in pids) and time.monotonic() - t_stop < 30:
            time.sleep(0.02)
        lease_s = time.monotonic() - t_stop
        alive = [p for p in pids if not _gone(p)]
        job.proc.kill()  # SIGKILL works on a stopped process
        return {
            "lease_s": lease_s if not alive else None,
            "nodes": len(pids),
            "alive_after_30s": alive,
            "stopped_at_step": at["step"],
        }
    finally:
        job.cleanup()


def stats(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="trials per side (default 5)")
    p.add_argument(
        "--steps",
        type=int,
        default=600,
        help="training steps per job: long enough to outlive the "
        "takeover (default 600; ~25-40 ms each on 2 cores with 3 replicas, ~3 ms on an idle big host)",
    )
    p.add_argument(
        "--kill-at", type=int, default=50, help="take the controller away once progress reaches this step (default 50)"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=2.0,
        help="resil-run --heartbeat-timeout; the target is this + 0.5 s (default 2.0)",
    )
    p.add_argument(
        "--controller-timeout",
        type=float,
        default=3.0,
        help="resil-run --controller-timeout (the nodes' lease), both sides; more than --heartbeat-timeout, "
        "as resil-run requires (default 3.0)",
    )
    p.add_argument(
        "--finish-timeout",
        type=float,
        default=120.0,
        help="seconds a standby job may take to finish after the takeover (default 120)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        help="keep each trial's events and stderr here (default: a temporary directory, removed)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (stdout) instead of the table")
    a = p.parse_args(argv)
    target = a.heartbeat_timeout + 0.5
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        root = a.work_dir or Path(tmp)
        trials: dict[str, list[dict[str, Any]]] = {"standby": [], "embedded": []}
        for i in range(a.repeats):
            for side, fn in (("standby", standby_trial), ("embedded", embedded_trial))[:: 1 if i % 2 == 0 else -1]:
                t0 = time.monotonic()
                try:
                    r = fn(root / f"{side}-{i}", a)
                except RuntimeError as e:
                    r = {"error": str(e)}
                trials[side].append(r)
                say(
                    f"{side} {i + 1}/{a.repeats} ({time.monotonic() - t0:.0f}s): "
                    + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
                )
    full = [r["full_s"] for r in trials["standby"] if "full_s" in r]
    takeover = [r["takeover_s"] for r in trials["standby"] if "takeover_s" in r]
    lease = [r["lease_s"] for r in trials["embedded"] if r.get("lease_s") is not None]
    med = statistics.median(full) if full else None
    ok = (
        med is not None
        and med <= target
        and len(full) == a.repeats
        and all(r.get("rc") == 0 for r in trials["standby"])
    )
    summary = {
        "target_s": target,
        "heartbeat_timeout_s": a.heartbeat_timeout,
        "controller_timeout_s": a.controller_timeout,
        "repeats": a.repeats,
        "cpus": os.cpu_count(),
        "standby_takeover_s": stats(takeover),
        "standby_full_s": stats(full),
        "embedded_lease_s": stats(lease),
        "ratio": med / target if med is not None else None,
        "pass": ok,
        "trials": trials,
    }
    if a.json:
        print(json.dumps(summary, indent=2))
    else:

        def row(name: str, s: dict[str, float | None]) -> str:
            return f"{name:<44}" + "".join(f"{v:>9.3f}" if v is not None else f"{'-':>9}" for v in s.values())

        print(
            f"controller loss, {a.repeats} repeats, {os.cpu_count()} CPUs, heartbeat timeout "
            f"{a.heartbeat_timeout:g} s, lease {a.controller_timeout:g} s"
        )
        print(f"{'':<44}{'median':>9}{'min':>9}{'max':>9}")
        print(row("standby x3: kill leader -> new leader", summary["standby_takeover_s"]))
        print(row("standby x3: kill leader -> full-strength step", summary["standby_full_s"]))
        print(row("embedded x1: SIGSTOP -> job lost, nodes gone", summary["embedded_lease_s"]))
        rcs = [r.get("rc", r.get("error")) for r in trials["standby"]]
        print(f"standby jobs' exit codes: {rcs}")
        ratio = f"{summary['ratio']:.2f}" if summary["ratio"] is not None else "-"
        print(f"target {target:g} s (heartbeat timeout + 0.5 s): median/target = {ratio} -> {'PASS' if ok else 'FAIL'}")
        if lease and med is not None:
            print(
                f"without a standby the job is lost and cleaned up in {statistics.median(lease):.2f} s; "
                f"with one it continues after {med:.2f} s"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
