"""Does a spare that joined the running job recover as fast as one the job started with?
(issue 35: spares join a running job.)

Two paths, side by side in one invocation, alternating run by run (startup, joined,
joined, startup, ...) so that neither always runs on a warmer machine:

- ``startup``: ``resil-run --local --nodes N+1 --spares 1``: the spare starts with the job.
- ``joined``:  ``resil-run --local --nodes N --spares 0``, then once the job trains at full
  strength ``resil-run --join RUN_DIR --local --nodes 1`` adds a spare; the bench waits
  until that spare's workers registered (qualified, started, waiting for ranks).

Then, on both, the node process of ``local-node0`` and all its workers are SIGKILLed
(the node is lost) and the bench waits for the first step committed at full strength in
the new epoch; the job is then stopped with SIGINT (resil-run ends it like Ctrl-C).

Measured (``t_mono`` of the events is CLOCK_MONOTONIC, the bench's own clock too):

- ``recovery_s``: the kill → ``full_strength_step`` of the next epoch;
- ``detect_s``: the kill → ``failure_detected``;
- ``admit_s`` (joined only): ``resil-run --join`` started → ``node_admitted``;
- ``ready_s`` (joined only): ``resil-run --join`` started → the joined node's workers all
  registered (what a cold spare from the queue costs after its job starts).

``ratio`` = median joined recovery_s / median startup recovery_s: 1.0 means a joined spare
is as good as a start-up one. Nothing here asserts on timings: it prints what it measured.

    python bench/join_spare.py [--runs 3] [--nodes 2] [--nproc-per-node 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

if __package__ in (None, ""):  # run by path: the repository root on sys.path for `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import REPO, resil_run, train

WAIT_S = 180.0  # any one wait (a start, a join, a recovery): beyond it the run failed
VICTIM = "local-node0"


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line still being written
    return out


def _wait(path: Path, pred: Callable[[dict[str, Any]], bool], what: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for e in _events(path):
            if pred(e):
                return e
        if proc.poll() is not None:
            raise RuntimeError(f"resil-run exited ({proc.returncode}) before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {WAIT_S:.0f}s")


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()


@dataclass
class Running:
    """A resil-run in the background (`running`) and the joiners it was given."""

    job: subprocess.Popen[str]
    log: TextIO
    env: dict[str, str]
    joiners: list[subprocess.Popen[str]] = field(default_factory=list)

    def join(self, run_dir: Path) -> None:
        """`resil-run --join RUN_DIR --local --nodes 1`, logging where the job logs."""
        argv = resil_run("--join", str(run_dir), nodes=1)
        self.joiners.append(
            subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        )


@contextlib.contextmanager
def running(path: str, cmd: list[str], tmp: Path) -> Iterator[Running]:
    """resil-run `cmd` in the background, logged to tmp/resil-run.log; stopped with its joiners
    at the end. A RuntimeError inside is raised again with `path` and the log's tail."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = (tmp / "resil-run.log").open("w")  # read when a run fails
    r = Running(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True), log, env)
    try:
        yield r
    except RuntimeError as e:
        raise RuntimeError(f"{path}: {e}; its log: {(tmp / 'resil-run.log').read_text()[-2000:]}") from None
    finally:
        _stop(r.job)
        for j in r.joiners:
            _stop(j)
        log.close()


def one_run(path: str, nodes: int, nproc: int, tmp: Path) -> dict[str, Any]:
    """One job on `path` ("startup" or "joined"): lose a node once a spare waits; -> timings."""
    tmp.mkdir(parents=True, exist_ok=True)
    run_dir, events = tmp / "run", tmp / "events.jsonl"
    spares = 1 if path == "startup" else 0
    cmd = resil_run(
        "--run-dir",
        str(run_dir),
        "--events",
        str(events),
        "--quiet",
        nodes=nodes + spares,
        spares=spares,
        nproc_per_node=nproc,
        worker=train(1_000_000),  # stopped by the bench once it measured the recovery
    )
    out: dict[str, Any] = {"path": path}
    with running(path, cmd, tmp) as r:
        job = r.job
        _wait(events, lambda e: e["event"] == "full_strength_step", "the first step", job)
        if path == "joined":
            t0 = time.monotonic()
            r.join(run_dir)
            admitted = _wait(events, lambda e: e["event"] == "node_admitted", "an admission", job)
            node = admitted["node"]
            out["admit_s"] = round(admitted["t_mono"] - t0, 3)
            registered = 0
            deadline = time.monotonic() + WAIT_S
            while registered < nproc and time.monotonic() < deadline:
                evs = _events(events)
                registered = sum(1 for e in evs if e["event"] == "worker_registered" and e.get("node") == node)
                time.sleep(0.05)
            if registered < nproc:
                raise RuntimeError(f"{node}'s workers did not register within {WAIT_S:.0f}s")
            last = [e for e in _events(events) if e["event"] == "worker_registered" and e.get("node") == node][-1]
            out["ready_s"] = round(last["t_mono"] - t0, 3)
        else:
            spare = f"local-node{nodes}"
            for _ in range(nproc):
                _wait(events, lambda e: e["event"] == "worker_registered" and e.get("node") == spare, "the spare", job)
        pid = [e["pid"] for e in _events(events) if e["event"] == "node_registered" and e["node"] == VICTIM][-1]
        t_kill = time.monotonic()
        os.killpg(pid, signal.SIGKILL)  # the node is lost: its node process and every worker
        detected = _wait(events, lambda e: e["event"] == "failure_detected", "the failure", job)
        full = _wait(
            events, lambda e: e["event"] == "full_strength_step" and e.get("epoch", 1) > 1, "full strength", job
        )
        out["detect_s"] = round(detected["t_mono"] - t_kill, 4)
        out["recovery_s"] = round(full["t_mono"] - t_kill, 4)
        taken = [e for e in _events(events) if e["event"] == "spare_assigned"]
        out["spare"] = taken[-1]["spare"] if taken else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs of each path (alternating)")
    p.add_argument("--nodes", type=int, default=2, help="active nodes (each path adds its one spare)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    if a.runs < 1 or a.nodes < 2 or a.nproc_per_node < 1:
        p.error("--runs >= 1, --nodes >= 2 (a survivor holds the lost node's replica), --nproc-per-node >= 1")
    runs = alternate(
        ("startup", "joined"), a.runs, lambda path, tmp: one_run(path, a.nodes, a.nproc_per_node, tmp), a.json
    )

    def med(path: str, key: str) -> float | None:
        return median_of(runs, path, key)

    summary: dict[str, Any] = {
        "startup_recovery_s": med("startup", "recovery_s"),
        "joined_recovery_s": med("joined", "recovery_s"),
        "joined_admit_s": med("joined", "admit_s"),
        "joined_ready_s": med("joined", "ready_s"),
    }
    s, j = summary["startup_recovery_s"], summary["joined_recovery_s"]
    summary["ratio"] = round(j / s, 3) if s and j else None
    report(runs, summary, a.json)
    return 0


def alternate(
    pair: tuple[str, str], n: int, one: Callable[[str, Path], dict[str, Any]], quiet: bool
) -> list[dict[str, Any]]:
    """`n` runs of each of two paths, alternating (a, b, b, a, ...) so that neither always
    runs on a warmer machine; `one(path, tmp)` -> its measurements (with "path")."""
    a, b = pair
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resild-bench-") as d:
        for i in range(n):
            for path in (a, b) if i % 2 == 0 else (b, a):
                r = one(path, Path(d) / f"{i}-{path}")
                runs.append(r)
                if not quiet:
                    print(f"run {i + 1}/{n} {path:8} " + " ".join(f"{k}={v}" for k, v in r.items() if k != "path"))
    return runs


def median_of(runs: list[dict[str, Any]], path: str, key: str) -> float | None:
    xs = [float(r[key]) for r in runs if r["path"] == path and r.get(key) is not None]
    return round(statistics.median(xs), 4) if xs else None


def report(runs: list[dict[str, Any]], summary: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"runs": runs, "summary": summary}))
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    sys.exit(main())
