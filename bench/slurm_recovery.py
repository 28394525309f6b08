"""Node-crash recovery under a real Slurm cluster: resild vs plain srun + checkpoint restart.

Brings up the project's Slurm lab (``tests/slurmlab``: a real slurmctld + one slurmd per
emulated node on this machine) with 4 nodes, then runs the same 3-node job twice and crashes
the same kind of node in each (``SlurmLab.crash``: SIGKILL of the node's slurmd, slurmstepd
and tasks -- a node that vanished):

(a) resild: ``resil-run --spares 1 --nproc-per-node 1 --heartbeat-timeout H`` around
    ``examples/train.py`` (2 active nodes + 1 hot spare). Victim: an active node that is not
    the batch host (the batch host runs the embedded controller).
(b) baseline: ``bench/slurm_baseline_job.sh``: ``srun -N2`` of ``bench/baseline_train.py``
    (same model/data, disk checkpoint every ``--ckpt-every`` steps); when srun fails the
    script finds the dead node in sinfo and re-runs srun on the 2 remaining nodes of its
    allocation, resuming from the checkpoint. Victim: the rank's node that is not the batch
    host.

In both, the node is crashed ``--kill-after-s`` seconds after the job's first committed step.
The crash time is this process's clock right after ``node.sh crash`` returned (its SIGKILL
is the last thing it does). Measured, in seconds from the crash:

- ``detect_s``: resild: ``failure_detected`` (heartbeat silence); baseline: the job script
  sees srun return non-zero (``srun_exit``).
- ``recovery_s``: the first step committed by the full-strength (2-rank) group after the
  crash: resild ``full_strength_step`` of the spare's epoch; baseline: the first step of the
  restarted srun written by every rank.
- ``steps_redone``: committed steps thrown away. resild: failure's committed step - resumed
  step; baseline: steps committed by every rank before the crash - checkpoint step resumed.
- baseline sub-phases: ``survivor_exit_s`` (the surviving rank's process exits: gloo saw
  the peer's connection reset), ``found_node_s`` (sinfo shows the dead node), ``resrun_s`` (the next
  srun starts), ``ready_s`` (every restarted rank has its group, model and checkpoint).
- ``ctld_marked_down_s``: slurmctld's log line "Nodes X not responding" (both sides; resild
  does not wait for it, srun does).
- ``ratio`` = baseline recovery_s / resild recovery_s.

Nothing here asserts on timings: it reports what it measured.

Usage (root; Slurm is installed by the lab's up.sh if missing)::

    .venv/bin/python -m bench.slurm_recovery                       # 400 steps, crash 3 s in
    .venv/bin/python -m bench.slurm_recovery --steps 400 --kill-after-s 3 --json
    .venv/bin/python -m bench.slurm_recovery --runs 2 --lab /tmp/resild-bench-lab

The lab (default ``/tmp/resild-bench-lab``) is always torn down at the end. It binds the
same ports as the test suite's lab (slurmctld 6917, slurmd 17100+i): do not run both at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if __package__ in (None, ""):  # run as a script: make `bench` and `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import resil_run, shell_line, train
from bench.common import read_events, select

if TYPE_CHECKING:
    from tests.slurmlab.fixture import SlurmLab

REPO = Path(__file__).resolve().parent.parent
BASELINE_JOB = REPO / "bench" / "slurm_baseline_job.sh"
DEFAULT_LAB = "/tmp/resild-bench-lab"
T = TypeVar("T")
LAB_NODES = 4


class BenchError(RuntimeError):
    pass


# -- small helpers ------------------------------------------------------------------------------
def _jsonl(path: Path) -> list[dict[str, Any]]:
    """Events in file order (read_events sorts by t_wall; these files are in order anyway)."""
    return read_events(path)


def _wait(
    what: str, pred: Callable[[], T | None], timeout_s: float, log: Path | None = None, poll_s: float = 0.05
) -> T:
    """What `pred` returns once it is true (not None, not empty, not False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise BenchError(f"{what}: not seen in {timeout_s:.0f}s\n{tail}")
        time.sleep(poll_s)


def _first(events: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    return next((e for e in events if pred(e)), None)


def _sbatch(lab: SlurmLab, args: list[str]) -> str:
    return lab.run(["sbatch", "--parsable", *args]).stdout.strip().split(";")[0]


def _wait_job_end(lab: SlurmLab, jid: str, timeout_s: float) -> str:
    from tests.slurmlab.fixture import _JOB_DONE

    deadline = time.monotonic() + timeout_s
    while True:
        res = lab.run(["scontrol", "show", "job", "-o", jid], check=False)
        state = next((w.split("=", 1)[1] for w in res.stdout.split() if w.startswith("JobState=")), "")
        if state in _JOB_DONE or (res.returncode != 0 and "Invalid job id" in res.stderr):
            return state or "GONE"
        if time.monotonic() > deadline:
            lab.run(["scancel", jid], check=False)
            return f"{state} (cancelled after {timeout_s:.0f}s)"
        time.sleep(0.2)


def _crash(lab: SlurmLab, node: str) -> tuple[float, float, float]:
    """Crash `node`; returns (time.time(), time.monotonic()) right after, and the call's length."""
    t0 = time.monotonic()
    lab.crash(node)
    t_wall, t_mono = time.time(), time.monotonic()
    return t_wall, t_mono, round(t_mono - t0, 3)


def _ctld_marked_down_s(lab: SlurmLab, node: str, t_crash: float) -> float | None:
    """Seconds from the crash to slurmctld's log line marking `node` not responding/DOWN."""
    try:
        lines = (lab.lab / "log" / "slurmctld.log").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if not line.startswith("[") or f"Nodes {node} not responding" not in line:
            continue
        try:
            t = datetime.strptime(line[1 : line.index("]")], "%Y-%m-%dT%H:%M:%S.%f").timestamp()
        except ValueError:
            continue
        if t >= t_crash - 0.01:
            return round(t - t_crash, 3)
    return None


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


# -- (a) resild --------------------------------------------------------------------------------
@contextlib.contextmanager
def _job_guard(lab: SlurmLab, jid: str, res: dict[str, Any]) -> Iterator[None]:
    """Cancel the job if the measurement fails; always record how the job ended."""
    try:
        yield
    except BaseException:
        lab.run(["scancel", jid], check=False)
        raise
    finally:
        res["job_state"] = _wait_job_end(lab, jid, 60)


def run_resild(
    lab: SlurmLab, work: Path, steps: int, kill_after_s: float, heartbeat_timeout: float, timeout_s: float = 240
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    events_path, out = work / "events.jsonl", work / "slurm.out"
    py = sys.executable
    script = work / "job.sh"
    resil_run_line = shell_line(
        resil_run(
            "--heartbeat-timeout",
            str(heartbeat_timeout),
            "--events",
            str(events_path),
            "--run-dir",
            f"{work}/run",
            "--json",
            local=False,
            spares=1,
            nproc_per_node=1,
            worker=train(steps, f"{work}/final.pt", script="examples/train.py", python=py),
            python=py,
        )
    )
    script.write_text(f"""#!/bin/bash
#SBATCH -N 3
#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH -t 10
#SBATCH -o {out}
export RESILD_CONTROLLER_HOST=127.0.0.1
cd {REPO}
{resil_run_line} > {work}/summary.json
rc=$?
echo $rc > {work}/rc
exit $rc
""")
    t_submit = time.time()
    jid = _sbatch(lab, [str(script)])
    res: dict[str, Any] = {"side": "resild", "job_id": jid, "workdir": str(work)}

    def ev() -> list[dict[str, Any]]:
        return _jsonl(events_path)

    with _job_guard(lab, jid, res):
        started = _wait("resild job_started", lambda: _first(ev(), lambda e: e["event"] == "job_started"), 120, out)
        host = started["controller_host"]
        member = _wait("resild membership", lambda: _first(ev(), lambda e: e["event"] == "membership"), 120, out)
        victim = next(n for n in member["layout"] if n != host)
        first = _wait(
            "resild first full_strength_step",
            lambda: _first(ev(), lambda e: e["event"] == "full_strength_step"),
            120,
            out,
        )
        res.update(
            batch_host=host,
            victim=victim,
            active=list(member["layout"]),
            queue_to_first_step_s=_r(first["t_wall"] - t_submit),
        )
        time.sleep(kill_after_s)
        if (work / "rc").exists():
            raise BenchError(f"resild job finished before the crash ({steps} steps too few for --kill-after-s)")
        t_crash_wall, t_crash_mono, res["crash_call_s"] = _crash(lab, victim)
        res["t_crash_wall"] = t_crash_wall

        assigned = _wait(
            "resild spare_assigned",
            lambda: _first(ev(), lambda e: e["event"] == "spare_assigned" and e["failed"] == victim),
            120,
            out,
        )
        full = _wait(
            "resild full-strength step after the crash",
            lambda: _first(ev(), lambda e: e["event"] == "full_strength_step" and e["epoch"] >= assigned["epoch"]),
            120,
            out,
        )
        evs = ev()
        det = _first(evs, lambda e: e["event"] == "failure_detected" and e["node"] == victim)
        resumed = _first(evs, lambda e: e["event"] == "resumed" and e.get("epoch", 0) >= assigned["epoch"])
        res.update(
            detect_s=_r(det["t_mono"] - t_crash_mono) if det else None,
            spare_assigned_s=_r(assigned["t_mono"] - t_crash_mono),
            resumed_s=_r(resumed["t_mono"] - t_crash_mono) if resumed else None,
            recovery_s=_r(full["t_mono"] - t_crash_mono),
            detector=det.get("detector") if det else None,
            committed_at_failure=det.get("committed_step") if det else None,
            resumed_step=resumed.get("step") if resumed else None,
            spare=assigned["spare"],
        )
        if det and resumed:
            res["steps_redone"] = max(0, int(det["committed_step"]) - int(resumed["step"]))
        _wait("resild job end", lambda: (work / "rc").exists(), timeout_s, out, poll_s=0.2)
        res["exit_code"] = int((work / "rc").read_text())
        try:
            summary = json.loads((work / "summary.json").read_text())
            res["summary_failures"] = summary.get("failures")
            res["steps_done"] = (summary.get("job") or {}).get("steps", summary.get("steps"))
        except (OSError, ValueError):
            pass
        res["sinfo_reason"] = lab.sinfo_reasons().get(victim)
        res["ctld_marked_down_s"] = _ctld_marked_down_s(lab, victim, t_crash_wall)
    return res


# -- (b) plain srun + checkpoint restart ----------------------------------------------------------
def run_baseline(
    lab: SlurmLab, work: Path, steps: int, kill_after_s: float, ckpt_every: int, timeout_s: float = 300
) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    events_path, jobev_path, out = work / "events.jsonl", work / "job_events.jsonl", work / "slurm.out"
    t_submit = time.time()
    jid = _sbatch(lab, ["-o", str(out), str(BASELINE_JOB), str(work), str(steps), str(ckpt_every)])
    res: dict[str, Any] = {"side": "srun+ckpt", "job_id": jid, "workdir": str(work), "ckpt_every": ckpt_every}

    def jev() -> list[dict[str, Any]]:
        return _jsonl(jobev_path)

    def ev() -> list[dict[str, Any]]:
        return _jsonl(events_path)

    with _job_guard(lab, jid, res):
        started = _wait("baseline job_started", lambda: _first(jev(), lambda e: e["event"] == "job_started"), 120, out)
        host = started["batch_host"]
        tasks = _wait(
            "baseline tasks", lambda: t if len(t := select(jev(), "task", attempt=0)) >= 2 else None, 120, out
        )
        victim = next(t["node"] for t in tasks if t["node"] != host)
        _wait("baseline first step", lambda: len(select(ev(), "step", restart_count=0, step=0)) >= 2, 120, out)
        t_first = max(e["t_wall"] for e in select(ev(), "step", restart_count=0, step=0))
        res.update(
            batch_host=host,
            victim=victim,
            active=sorted(t["node"] for t in tasks),
            queue_to_first_step_s=_r(t_first - t_submit),
        )
        time.sleep(kill_after_s)
        if select(jev(), "srun_exit", attempt=0):
            raise BenchError(f"baseline srun ended before the crash ({steps} steps too few for --kill-after-s)")
        t_crash, _, res["crash_call_s"] = _crash(lab, victim)
        res["t_crash_wall"] = t_crash

        def restarted_first_step() -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]] | None:
            evs = ev()
            ready = select(evs, "ready", restart_count=1)
            if len(ready) < 2:
                return None
            k = min(e["resumed_step"] for e in ready)
            s = select(evs, "step", restart_count=1, step=k)
            return (ready, k, s) if len(s) >= 2 else None

        def recovered_or_gave_up() -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]] | None:
            got = restarted_first_step()
            if not got and (select(jev(), "gave_up") or select(jev(), "srun_exit", attempt=1)):
                tail = out.read_text()[-3000:] if out.exists() else ""
                raise BenchError(f"baseline job did not recover: {jev()[-3:]}\n{tail}")
            return got

        ready, resumed_step, first_steps = _wait(
            "baseline first step after restart", recovered_or_gave_up, timeout_s, out
        )
        evs, jevs = ev(), jev()
        ex0 = _first(jevs, lambda e: e["event"] == "srun_exit" and e["attempt"] == 0)
        found = _first(jevs, lambda e: e["event"] == "failed_nodes")
        start1 = _first(jevs, lambda e: e["event"] == "srun_start" and e["attempt"] == 1)
        starts1 = select(evs, "start", restart_count=1)
        exits0 = select(jevs, "task_exit", attempt=0)
        per_rank_last = [
            max((e["step"] for e in select(evs, "step", restart_count=0, rank=r)), default=-1) for r in (0, 1)
        ]
        committed = min(per_rank_last) + 1  # steps every rank finished before the crash
        res.update(
            detect_s=_r(ex0["t_wall"] - t_crash) if ex0 else None,
            srun_rc=ex0.get("rc") if ex0 else None,
            survivor_exit_s=_r(min(e["t_wall"] for e in exits0) - t_crash) if exits0 else None,
            found_node_s=_r(found["t_wall"] - t_crash) if found else None,
            found_nodes=found.get("nodes") if found else None,
            resrun_s=_r(start1["t_wall"] - t_crash) if start1 else None,
            workers_start_s=_r(min(e["t_wall"] for e in starts1) - t_crash) if starts1 else None,
            ready_s=_r(max(e["t_wall"] for e in ready) - t_crash),
            recovery_s=_r(max(e["t_wall"] for e in first_steps) - t_crash),
            committed_at_crash=committed,
            resumed_step=resumed_step,
            steps_redone=committed - resumed_step,
            restart_nodes=sorted(t["node"] for t in select(jevs, "task", attempt=1)),
            ctld_marked_down_s=_ctld_marked_down_s(lab, victim, t_crash),
        )
        ends = _wait(
            "baseline job end",
            lambda: select(jev(), "srun_exit", attempt=1) or select(jev(), "gave_up"),
            timeout_s,
            out,
            poll_s=0.2,
        )
        res["exit_code"] = ends[-1].get("rc")
        res["steps_done"] = sum(1 for _ in select(ev(), "done"))
    return res


# -- driver ---------------------------------------------------------------------------------------
def _restore_all(lab: SlurmLab) -> None:
    for node in lab.nodes:
        lab.restore(node)


COLUMNS = (("detect_s", "detection"), ("recovery_s", "recovery"), ("steps_redone", "redone"))


def format_table(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    def f(v: object, d: int = 2) -> str:
        return "-" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))

    lines = [f"{'run':>3}  {'side':<10} {'detection':>10} {'recovery':>9} {'redone':>6}  notes", "-" * 100]
    ratios: list[float] = []
    for i, (a, b) in enumerate(pairs, 1):
        if a:
            lines.append(
                f"{i:>3}  {'resild':<10} {f(a.get('detect_s')):>9}s {f(a.get('recovery_s')):>8}s "
                f"{f(a.get('steps_redone')):>6}  victim {a.get('victim')}, spare {a.get('spare')}, "
                f"detector {a.get('detector')}{'; ' + a['error'] if a.get('error') else ''}"
            )
        if b:
            lines.append(
                f"{'':>3}  {'srun+ckpt':<10} {f(b.get('detect_s')):>9}s {f(b.get('recovery_s')):>8}s "
                f"{f(b.get('steps_redone')):>6}  victim {b.get('victim')}; survivor exits "
                f"{f(b.get('survivor_exit_s'))}s, ctld marks node down {f(b.get('ctld_marked_down_s'))}s, "
                f"srun again {f(b.get('resrun_s'))}s, ranks ready {f(b.get('ready_s'))}s"
                f"{'; ' + b['error'] if b.get('error') else ''}"
            )
        if a.get("recovery_s") and b.get("recovery_s"):
            ratio = b["recovery_s"] / a["recovery_s"]
            ratios.append(ratio)
            lines.append(f"{'':>3}  ratio (srun+ckpt / resild recovery): {ratio:.1f}x")
    if len(ratios) > 1:
        lines.append(f"median ratio over {len(ratios)} runs: {statistics.median(ratios):.1f}x")
    lines.append(
        "seconds from the crash; detection: resild failure_detected / srun returns non-zero; "
        "recovery: first step committed by both ranks after it"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Slurm node crash: resild vs srun + checkpoint restart",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-after-s", type=float, default=3.0, help="crash this long after the first committed step")
    p.add_argument("--ckpt-every", type=int, default=50, help="baseline checkpoint interval (steps)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.5, help="resild --heartbeat-timeout")
    p.add_argument("--runs", type=int, default=1, help="repeat (resild, baseline) this many times in one lab")
    p.add_argument("--only", choices=("resild", "srun"), help="run one side only")
    p.add_argument("--lab", default=DEFAULT_LAB, help="lab directory for tests/slurmlab/up.sh")
    p.add_argument("--workdir", type=Path, help="job directories go here (default: a new temporary directory)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    import pytest  # the lab fixture reports "unavailable" with pytest.skip/fail

    from tests.slurmlab.fixture import slurm_cluster

    # Leave /etc/slurm/slurm.conf alone (the test suite's lab links it); we always set SLURM_CONF.
    os.environ.setdefault("LINK_ETC", "0")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="resild-slurm-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    errors: list[str] = []
    t0 = time.monotonic()
    lab_up_s = None
    try:
        with slurm_cluster(LAB_NODES, lab=args.lab) as lab:
            lab_up_s = round(lab.up_seconds, 1)
            print(f"lab up in {lab.up_seconds:.1f}s ({args.lab}); job dirs under {work}", file=sys.stderr)

            def side(label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
                try:
                    out = fn()
                except BenchError as e:
                    errors.append(f"{label}: {e}")
                    out = {"error": str(e).splitlines()[0]}
                print(f"{label}: {json.dumps(out)}", file=sys.stderr)
                _restore_all(lab)
                return out

            for i in range(1, args.runs + 1):
                a = (
                    {}
                    if args.only == "srun"
                    else side(
                        f"run {i} resild",
                        lambda: run_resild(
                            lab, work / f"run{i}-resild", args.steps, args.kill_after_s, args.heartbeat_timeout
                        ),
                    )
                )
                b = (
                    {}
                    if args.only == "resild"
                    else side(
                        f"run {i} srun+ckpt",
                        lambda: run_baseline(
                            lab, work / f"run{i}-srun", args.steps, args.kill_after_s, args.ckpt_every
                        ),
                    )
                )
                pairs.append((a, b))
    except (pytest.skip.Exception, pytest.fail.Exception) as e:  # lab could not come up
        print(f"slurm lab unavailable: {e}", file=sys.stderr)
        return 3
    wall = round(time.monotonic() - t0, 1)
    if args.json:
        ratios = [b["recovery_s"] / a["recovery_s"] for a, b in pairs if a.get("recovery_s") and b.get("recovery_s")]
        print(
            json.dumps(
                {
                    "steps": args.steps,
                    "kill_after_s": args.kill_after_s,
                    "ckpt_every": args.ckpt_every,
                    "heartbeat_timeout": args.heartbeat_timeout,
                    "lab_up_s": lab_up_s,
                    "wall_s": wall,
                    "runs": [
                        {
                            "resild": a,
                            "srun_ckpt": b,
                            "ratio": _r(b["recovery_s"] / a["recovery_s"], 2)
                            if a.get("recovery_s") and b.get("recovery_s")
                            else None,
                        }
                        for a, b in pairs
                    ],
                    "median_ratio": _r(statistics.median(ratios), 2) if ratios else None,
                    "errors": errors,
                },
                indent=1,
            )
        )
    else:
        print(format_table(pairs))
        for err in errors:
            print(f"error: {err}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
