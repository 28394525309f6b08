"""resild and NVIDIA's resiliency extension (NVRx) 0.4.1, side by side in one invocation.

The same model, data and fault as ``bench/recovery.py`` and ``bench/peers_torchft.py``:
``examples/train.py``'s model (~0.9M params, Adam + StepLR), one intra-op thread, gloo on CPU,
4 training ranks (2 nodes x 2), the worker at global rank 2 (worker 0 of node 1) SIGKILLed once
``--kill-at`` steps are committed (``--fault hang``: SIGSTOPped instead).

Three systems (the NVRx workers are ``bench/nvrx_train.py``, run by the NVRx venv's python):

- resild: ``bench/recovery.py``'s ``run_resild`` (``resil-run --local``, one hot spare node).
- NVRx in-process restart: ``inprocess.Wrapper`` around the training function, 3 nodes x 2 ranks
  started by this script with RANK/WORLD_SIZE/MASTER_* set, a ``Tree`` rank assignment that keeps
  4 ranks active and the third node's 2 ranks as hot spares, replaces a node whole, and the
  state copied from the surviving rank 0 by broadcast (see ``nvrx_train.py``).
- NVRx ``ft_launcher``: its torchrun-like launcher, ``--standalone --nproc-per-node 4
  --max-restarts 3`` (``bench/recovery.py``'s torchrun layout), ranks sending heartbeats to its
  rank monitors; a restart respawns every rank, which reloads a disk checkpoint written every
  ``--ckpt-every`` steps.

Each NVRx side runs with two profiles (``FTL_PROFILES`` below, ``nvrx_train.INPROCESS_PROFILES``):
"documented" (its defaults and its examples' values) and "tuned" (every timeout and interval as
low as a healthy run here allows).

``--fault hang`` (SIGSTOP): resild finds it with ``--hang-timeout`` (2 s). The in-process
Wrapper: the stopped rank's monitor process sees no progress, ``soft_timeout`` asks for a restart
and ``hard_timeout`` (+ ``termination_grace_time``) kills the rank. ft_launcher: its rank
monitors kill a rank after ``rank_heartbeat_timeout``; that is 45 min by default, so in the
"documented" profile the survivors' gloo timeout (60 s, ``bench/recovery.py``'s torchrun value;
torch's own default is 30 min) ends the hang, then the launcher waits its 30 s workers-stop
timeout for the stopped rank before it restarts.

Measured for each, as in ``peers_torchft.py`` (wall clock, one machine): fault → training again
(first step committed after the fault), fault → full strength (first step committed by 4 ranks;
the same here, all three replace the lost ranks), steps redone, work lost in seconds of
full-strength training (stall + redone steps x step time), goodput over the training window
(new steps x median step / window), the failure-free step time; and where the recovery time
goes: ``to_reentry_s`` (fault → every rank back in the training function: resild detect + fence
+ announce + notify; in-process: detection, abort, barrier, rank reassignment; ft_launcher:
detection, stopping the survivors and spawning new processes up to their first line),
``group_state_s`` (new group + state: resild re-form + replay; in-process ``init_process_group``
+ broadcast; ft_launcher import torch, init, load the checkpoint), ``first_step_s``.

Setting up the NVRx venv (``python bench/peers_nvrx.py --setup`` does this)::

    /work/main/.venv/bin/python -m venv .venv-nvrx          # resild's interpreter, a separate venv
    .venv-nvrx/bin/pip install torch==2.13.0                 # resild's torch; where pip has a local
                                                             # CPU wheel (find-links) it takes that
    .venv-nvrx/bin/pip install nvidia-resiliency-ext==0.4.1  # its deps are pure Python (psutil,
                                                             # pyyaml, pynvml, nvidia-ml-py, ...)

0.4.1 is the newest NVRx that pip installs here (CPython 3.11, glibc 2.36): it finds no 0.5 or
later wheel for this platform. Without a GPU, both parts run: the Wrapper's abort calls
``destroy_process_group`` (its NCCL-only abort is skipped for gloo) and ``CudaHealthCheck`` is a
no-op; ft_launcher's rank monitors log that NVML is missing (GPU health checks disabled) and
that /sys/class/infiniband is absent (NIC monitor), and go on. What does not carry over from
NCCL: a gloo collective blocked on a dead peer is not interrupted by the abort (pytorch#130345,
in NVRx's known issues), so the in-process restart waits for the gloo timeout on ranks not
directly connected to the dead one; its documented workaround, a short gloo timeout, is the
tuned profile's main lever.

    python bench/peers_nvrx.py                           # both profiles, one run each, ABBA order
    python bench/peers_nvrx.py --runs 3 --json
    python bench/peers_nvrx.py --only inprocess --profile tuned --fault hang
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import torchrun
from bench.common import read_events
from bench.nvrx_train import INPROCESS_PROFILES

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "nvrx_train.py"
DEFAULT_VENV = REPO / ".venv-nvrx"
NVRX_VERSION = "0.4.1"
#: seconds a job may take to exit once training is done before it is killed (NVRx 0.4.1's
#: termination barrier sometimes crashes on a malformed store value and leaves a rank waiting)
EXIT_GRACE_S = 30.0


class FtlProfile(TypedDict):
    launcher_args: list[str]  # ft_launcher's own flags, after torchrun's
    gloo_timeout: float


#: ft_launcher settings. "documented": its defaults (monitor interval 0.1 s, workload check 5 s,
#: heartbeat timeouts 60 / 45 min, NIC monitor on) with recovery.py's torchrun gloo timeout;
#: "tuned": the launcher's and the rank monitors' intervals and timeouts turned down.
FTL_PROFILES: dict[str, FtlProfile] = {
    "documented": FtlProfile(launcher_args=[], gloo_timeout=60.0),
    "tuned": FtlProfile(
        launcher_args=[
            "--monitor-interval",
            "0.02",
            "--workers-stop-timeout",
            "1",
            "--ft-workload-check-interval",
            "0.1",
            "--ft-initial-rank-heartbeat-timeout",
            "120",
            "--ft-rank-heartbeat-timeout",
            "2",
            "--ft-node-health-check-interval",
            "5",
            "--ft-enable-nic-monitor",
            "false",
        ],
        gloo_timeout=2.0,
    ),
}
PROFILE_NAMES = ("documented", "tuned")
COLS = (
    "training_again_s",
    "full_strength_s",
    "steps_redone",
    "lost_s",
    "goodput",
    "step_time_s",
    "to_reentry_s",
    "group_state_s",
    "first_step_s",
    "restarts",
)


# ---- the NVRx venv ------------------------------------------------------------------------------
def check_nvrx(python: Path) -> str | None:
    """None if ``python`` imports nvidia_resiliency_ext and torch, else why not (one line)."""
    if not python.exists():
        return f"{python} does not exist"
    r = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m, torch, nvidia_resiliency_ext.inprocess; "
            "print(m.version('nvidia-resiliency-ext'))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "error"},
    )
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["import failed"])[-1]
    if r.stdout.strip() != NVRX_VERSION:
        return f"nvidia-resiliency-ext {r.stdout.strip()} installed, this script was written for {NVRX_VERSION}"
    return None


def setup_venv(venv: Path) -> int:
    """Create ``venv`` with resild's interpreter, resild's torch and NVRx 0.4.1 (see the module doc)."""
    import torch

    torch_version = torch.__version__.split("+")[0]
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", f"torch=={torch_version}"],
        [str(venv / "bin" / "pip"), "install", f"nvidia-resiliency-ext=={NVRX_VERSION}"],
    ]
    for cmd in steps:
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        if subprocess.run(cmd).returncode != 0:
            print(f"peers_nvrx: setup failed at: {' '.join(cmd)}", file=sys.stderr)
            return 1
    why = check_nvrx(venv / "bin" / "python")
    print(f"peers_nvrx: {'ready' if why is None else 'still not usable: ' + why}: {venv}", file=sys.stderr)
    return 0 if why is None else 1


# ---- helpers ---------------------------------------------------------------------------------
def _free_base_port(n: int = 3) -> int:
    """A port p with p .. p+n-1 free now (the in-process job uses MASTER_PORT, +1 and +2)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base: int = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def _kill_monitor_daemons(events: list[dict[str, Any]]) -> None:
    """The Wrapper's monitor processes daemonize (setsid): end leftovers by the pids they reported."""
    for pid in {e["monitor_pid"] for e in events if e.get("monitor_pid")}:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"nvrx_train.py" in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_all(
    procs: list[subprocess.Popen[bytes]], timeout_s: float, finished: Callable[[], bool] | None = None
) -> str:
    """Wait for ``procs``; kill what is left at the deadline, or EXIT_GRACE_S after ``finished()``.

    Returns "" (all exited), "timed out", or "hung at exit" (training done, a process stuck).
    """
    deadline = time.monotonic() + timeout_s
    done_at: float | None = None
    outcome = ""
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            outcome = "timed out"
            break
        if finished is not None and done_at is None and finished():
            done_at = now
        if done_at is not None and now - done_at > EXIT_GRACE_S:
            outcome = "hung at exit"
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return outcome


def analyze_nvrx(events: list[dict[str, Any]], active: int, attempt_key: str) -> dict[str, Any]:
    """The metrics of ``peers_torchft.analyze_torchft``, for a job that never runs at reduced strength.

    ``attempt_key`` numbers the attempts in the events (``iteration``: the in-process restart;
    ``restart_count``: ft_launcher). Commits are told apart by attempt, not by time: rank 0 may
    commit the step in flight a moment after the fault. A recovery that itself failed (a second
    restart) is counted in ``restarts``; the phases describe the attempt that trained.
    """
    res: dict[str, Any] = dict.fromkeys((*COLS, "steps_reduced", "steps", "copy_bytes", "restarts"))

    def mine(e: dict[str, Any]) -> bool:
        return (e.get(attempt_key) or 0) >= 1

    steps = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    if not steps:
        return res
    before = [e for e in steps if not mine(e)]
    after = [e for e in steps if mine(e)]
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    t_f = fault["t_wall"] if fault else None
    # Failure-free step time: consecutive commits of one attempt, not across the fault.
    gaps = [
        b["t_wall"] - a["t_wall"]
        for run in (before, after)
        for a, b in zip(run, run[1:])
        if b["step"] == a["step"] + 1 and (t_f is None or not a["t_wall"] < t_f < b["t_wall"])
    ]
    st = res["step_time_s"] = statistics.median(gaps) if gaps else None
    res["steps"] = max(e["step"] for e in steps)
    res["steps_reduced"] = sum(1 for e in after if e["participants"] < active)
    window = steps[-1]["t_wall"] - steps[0]["t_wall"]
    if st and window > 0:
        # new steps only: a redone step is not progress
        res["goodput"] = (res["steps"] - steps[0]["step"]) * st / window
    if t_f is None or not after:
        return res
    res["training_again_s"] = after[0]["t_wall"] - t_f
    full = next((e for e in after if e["participants"] >= active), None)
    res["full_strength_s"] = full["t_wall"] - t_f if full else None
    res["steps_redone"] = max(0, max((e["step"] for e in before), default=0) - (after[0]["step"] - 1))
    res["lost_s"] = res["training_again_s"] + res["steps_redone"] * (st or 0.0)
    won = after[0].get(attempt_key)
    res["restarts"] = won
    entered = [e["t_wall"] for e in events if e["event"] in ("iteration_start", "start") and e.get(attempt_key) == won]
    resumed = [e for e in events if e["event"] == "resumed" and e.get(attempt_key) == won]
    if entered:
        res["to_reentry_s"] = max(entered) - t_f
    if resumed:
        t_res = max(e["t_wall"] for e in resumed)
        if entered:
            res["group_state_s"] = t_res - max(entered)
        res["first_step_s"] = after[0]["t_wall"] - t_res
        res["copy_bytes"] = max(e.get("bytes") or 0 for e in resumed) or None
    return res


# ---- NVRx in-process restart -------------------------------------------------------------------
def run_inprocess(
    python: Path,
    profile: str,
    a: argparse.Namespace,
    workdir: Path,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    ppn: int = a.nproc_per_node
    active = 2 * ppn
    world = active + ppn  # one spare node
    port = _free_base_port()
    procs, logs = [], []
    t0 = time.time()
    try:
        for r in range(world):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r % ppn),
                "LOCAL_WORLD_SIZE": str(ppn),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "error",  # the Wrapper's store polling warns on every timeout
            }
            log = open(workdir / f"rank{r}.log", "wb")
            logs.append(log)
            cmd = [
                str(python),
                str(WORKER),
                "--mode",
                "inprocess",
                "--events",
                str(events),
                "--steps",
                str(a.steps),
                "--kill-at",
                str(a.kill_at),
                "--kill-rank",
                str(ppn),
                "--fault",
                a.fault,
                "--profile",
                profile,
                "--active",
                str(active),
                "--nproc-per-node",
                str(ppn),
                "--logdir",
                str(workdir),
                "--seed",
                str(a.seed),
            ]
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )

        def finished() -> bool:
            return sum(1 for e in read_events(events) if e["event"] == "done") >= active

        outcome = _wait_all(procs, a.timeout, finished)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        _kill_monitor_daemons(_read(events))
    res = analyze_nvrx(_read(events), active, "iteration")
    res.update(
        system=f"NVRx in-process ({profile})",
        exit_codes=[p.returncode for p in procs],
        timed_out=outcome == "timed out",
        exit_problem=outcome or (None if res["steps"] else "did not train (see the rank logs)"),
        wall_s=time.time() - t0,
        workdir=str(workdir),
        settings=INPROCESS_PROFILES[profile],
    )
    return res


# ---- NVRx ft_launcher ----------------------------------------------------------------------------
def run_ftl(python: Path, profile: str, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    events, ckpt = workdir / "events.jsonl", workdir / "ckpt.pt"
    for f in (events, ckpt):
        f.unlink(missing_ok=True)
    prof = FTL_PROFILES[profile]
    nproc = 2 * a.nproc_per_node
    cmd = torchrun(
        *prof["launcher_args"],
        str(WORKER),
        "--mode",
        "ftl",
        "--events",
        str(events),
        "--ckpt",
        str(ckpt),
        "--ckpt-every",
        str(a.ckpt_every),
        "--steps",
        str(a.steps),
        "--kill-at",
        str(a.kill_at),
        "--kill-rank",
        str(a.nproc_per_node),
        "--fault",
        a.fault,
        "--gloo-timeout",
        str(prof["gloo_timeout"]),
        "--seed",
        str(a.seed),
        nproc_per_node=nproc,
        max_restarts=3,
        module="nvidia_resiliency_ext.fault_tolerance.launcher",
        python=str(python),
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "error"}
    t0 = time.time()
    with open(workdir / "ft_launcher.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        outcome = _wait_all([proc], a.timeout)
    res = analyze_nvrx(_read(events), nproc, "restart_count")
    res.update(
        system=f"NVRx ft_launcher ({profile})",
        exit_codes=[proc.returncode],
        timed_out=outcome == "timed out",
        exit_problem=outcome or (None if res["steps"] else "did not train (see ft_launcher.log)"),
        wall_s=time.time() - t0,
        workdir=str(workdir),
        settings=prof,
    )
    return res


# ---- resild -------------------------------------------------------------------------------------
def run_resild_side(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from bench.recovery import run_resild

    ppn = a.nproc_per_node
    hang = a.hang_timeout if a.fault == "hang" else None
    r = run_resild(2 * ppn, ppn, a.steps, a.kill_at, workdir, a.timeout, fault=a.fault, hang_timeout_s=hang)
    parts = [r.get(k) for k in ("detect_s", "fence_s", "announce_s", "notify_s")]
    total, redone = r.get("total_s"), r.get("steps_redone")
    return {
        "system": "resild (1 hot spare)",
        # the spare holds exactly the failed node's ranks: back to training = back to full strength
        "training_again_s": total,
        "full_strength_s": total,
        "steps_reduced": 0,
        # -1: the step in flight was committed before the group re-formed; nothing was redone
        "steps_redone": max(0, redone) if redone is not None else None,
        "lost_s": total + max(0, redone or 0) * (r.get("step_time_s") or 0.0) if total is not None else None,
        "restarts": 1 if total is not None else None,
        "goodput": r.get("goodput"),
        "step_time_s": r.get("step_time_s"),
        "to_reentry_s": sum(x for x in parts if x is not None) if None not in parts else None,
        "group_state_s": r.get("recover_s"),
        "first_step_s": r.get("first_step_s"),
        "copy_bytes": r.get("replay_bytes"),
        "steps": r.get("steps_completed"),
        "exit_codes": [r.get("exit_code")],
        "timed_out": r.get("timed_out"),
        "wall_s": r.get("wall_s"),
        "workdir": str(workdir),
    }


def _read(path: Path) -> list[dict[str, Any]]:
    return sorted(read_events(path), key=lambda e: e["t_wall"])


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Recovery after one SIGKILLed worker: resild vs NVRx in-process restart vs NVRx ft_launcher",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--nvrx-python", type=Path, default=DEFAULT_VENV / "bin" / "python", help="the NVRx venv's python")
    p.add_argument("--setup", action="store_true", help="create the NVRx venv (--venv) and exit")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="where --setup creates the venv")
    p.add_argument("--profile", choices=[*PROFILE_NAMES, "both"], default="both")
    p.add_argument("--only", choices=("resild", "inprocess", "ftl"), action="append", help="repeatable")
    p.add_argument("--fault", choices=("kill", "hang"), default="kill")
    p.add_argument("--hang-timeout", type=float, default=2.0, help="resild --hang-timeout with --fault hang")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=130)
    p.add_argument("--ckpt-every", type=int, default=50, help="ft_launcher: disk checkpoint every N steps")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--runs", type=int, default=1, help="rounds; the order of the sides alternates (ABBA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.setup:
        return setup_venv(a.venv)
    if not 0 < a.kill_at < a.steps:
        p.error("--kill-at must be inside (0, --steps)")
    sides = a.only or ["resild", "inprocess", "ftl"]
    python = a.nvrx_python.absolute()  # not resolve(): a venv's python is a symlink to the base interpreter
    if {"inprocess", "ftl"} & set(sides):
        why = check_nvrx(python)
        if why is not None:
            print(
                f"peers_nvrx: the NVRx python is not usable ({why}).\n"
                f"Create the venv with:  python bench/peers_nvrx.py --setup [--venv DIR]\n"
                f"or pass another with --nvrx-python (see the set-up in `--help`).",
                file=sys.stderr,
            )
            return 2
    profiles = list(PROFILE_NAMES) if a.profile == "both" else [a.profile]
    jobs: list[tuple[str, str | None]] = []
    for s in sides:
        jobs += [(s, None)] if s == "resild" else [(s, pr) for pr in profiles]
    wd = a.workdir or Path(tempfile.mkdtemp(prefix="resild-nvrx-"))
    rows: list[dict[str, Any]] = []
    for i in range(a.runs):
        order = jobs if i % 2 == 0 else jobs[::-1]  # ABBA: no side always runs on a warmer machine
        for side, prof in order:
            name = side if prof is None else f"{side}-{prof}"
            if not a.json:
                print(f"run {i + 1}: {name} (load {_loadavg()}) ...", file=sys.stderr, flush=True)
            load = _loadavg()
            if side == "resild":
                r = run_resild_side(a, wd / f"{name}-{i}")
            elif side == "inprocess":
                r = run_inprocess(python, prof or "documented", a, wd / f"{name}-{i}")
            else:
                r = run_ftl(python, prof or "documented", a, wd / f"{name}-{i}")
            r.update(run=i + 1, loadavg_before=load, fault=a.fault)
            rows.append(r)
            if a.json:
                print(json.dumps(r), flush=True)

    med: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        d = med.setdefault(r["system"], {k: [] for k in COLS})
        for k in COLS:
            if isinstance(r.get(k), (int, float)):
                d[k].append(float(r[k]))
    summary: dict[str, dict[str, float | None]] = {
        s: {k: (statistics.median(v) if v else None) for k, v in d.items()} for s, d in med.items()
    }
    rs = summary.get("resild (1 hot spare)") or {}
    ratios: dict[str, dict[str, float | None]] = {}
    for s, m in summary.items():
        rf, pf, rl, pl = rs.get("full_strength_s"), m.get("full_strength_s"), rs.get("lost_s"), m.get("lost_s")
        if s.startswith("NVRx") and rf and pf:
            ratios[s] = {"full_strength": rf / pf, "lost": rl / pl if rl and pl else None}
    if a.json:
        print(json.dumps({"summary": True, "medians": summary, "ratios_resild_over_peer": ratios, "workdir": str(wd)}))
        return 0 if all(not r.get("timed_out") for r in rows) else 1
    fault = "SIGKILL" if a.fault == "kill" else "SIGSTOP (hang)"
    print(
        f"\n{fault} of global rank {a.nproc_per_node} once {a.kill_at} of {a.steps} steps are committed; "
        f"4 ranks, examples/train.py model, gloo on CPU; seconds (load average now {_loadavg()})"
    )
    print(f"{'system':<30}{'run':>4}" + "".join(f"{c:>17}" for c in COLS) + f"{'exit':>18}")
    for r in rows:
        print(
            f"{r['system']:<30}{r['run']:>4}"
            + "".join(f"{_fmt(r.get(c)):>17}" for c in COLS)
            + f"{','.join(map(str, r.get('exit_codes') or [])):>18}"
            + (f" {r['exit_problem'].upper()}" if r.get("exit_problem") else "")
        )
    for s, q in ratios.items():
        print(
            f"resild / {s}: fault -> full strength {q['full_strength']:.3f}x"
            + (f", work lost {q['lost']:.3f}x" if q["lost"] else "")
        )
    print(f"(logs and events under {wd})")
    return 0 if all(not r.get("timed_out") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
