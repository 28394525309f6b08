"""resild and torchft 0.2, side by side in one invocation: the same model, data and fault.

torchft (pip ``torchft==0.2.0``, the ``bench`` extra) is set up the way its README documents:
a lighthouse (``LighthouseServer``: min_replicas 1, quorum_tick_ms 100, join_timeout_ms
10000, heartbeat_timeout_ms its default), one replica group per node, each group run by
``torchrun --max-restarts 3`` with ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` set, a
``Manager`` (``ProcessGroupGloo``, min_replica_size 1, its default timeouts) and live
recovery: a restarted group fetches the state from a healthy group. Gradients are averaged
inside a group with a plain gloo all-reduce and across groups with ``manager.allreduce``;
the optimizer and scheduler step only when ``manager.should_commit()`` says so (what
torchft's ``OptimizerWrapper`` does; its DDP wrapper is not used: it crashed the survivor
when a peer died, in the measurements in the design notes). ``--profile tuned`` turns every
timeout down as far as torchft lets it run (see PROFILES).

resild runs through ``bench/recovery.py``'s ``run_resild`` (``resil-run --local``, one hot
spare). Both: ``examples/train.py``'s model (~0.9M params, Adam + StepLR), one intra-op
thread, gloo on CPU, 2 nodes x 2 ranks, worker 0 of node 1 SIGKILLed once ``--kill-at``
steps are committed.

Measured for each (wall clock, one machine):
- fault → training again: the first step committed after the fault (torchft: by the
  surviving group, at reduced strength; resild: by the re-formed full group);
- fault → full strength: the first step committed with every group / rank taking part;
- steps at reduced strength (torchft: steps the survivors took without the failed group);
- steps redone (committed steps computed again);
- work lost, in seconds of full-strength training: the stall, the samples a missing group
  did not train while the others went on, and redone steps;
- goodput over the training window (first → last committed step): committed steps x the
  share of groups taking part x the median failure-free step / the window (on this
  oversubscribed CPU machine survivors run faster without their peers, which a GPU would
  not: torchft's goodput reads high, even above 1; work lost is the fairer figure);
- failure-free step time.

    python bench/peers_torchft.py                       # documented settings, then tuned
    python bench/peers_torchft.py --profile tuned --runs 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict

from resild.events.log import read_events

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()


class Profile(TypedDict):
    quorum_tick_ms: int
    join_timeout_ms: int
    heartbeat_timeout_ms: int | None  # None: the lighthouse's default
    timeout_s: float
    quorum_timeout_s: float
    connect_timeout_s: float
    heartbeat_interval_ms: int


# Lighthouse and Manager settings. "documented": torchft's README (lighthouse flags) and the
# Manager's defaults. "tuned": as low as they go here without breaking a healthy run.
PROFILES: dict[str, Profile] = {
    "documented": Profile(
        quorum_tick_ms=100,
        join_timeout_ms=10000,
        heartbeat_timeout_ms=None,
        timeout_s=60.0,
        quorum_timeout_s=60.0,
        connect_timeout_s=60.0,
        heartbeat_interval_ms=100,
    ),
    "tuned": Profile(
        quorum_tick_ms=10,
        join_timeout_ms=100,
        heartbeat_timeout_ms=300,
        timeout_s=3.0,
        quorum_timeout_s=3.0,
        connect_timeout_s=10.0,
        heartbeat_interval_ms=50,
    ),
}


# ---- worker (run by torchrun, one per rank of a replica group) -----------------------------
def _emit(path: str, event: str, **fields: Any) -> None:
    rec = {
        "event": event,
        "t_wall": time.time(),
        "pid": os.getpid(),
        "group": int(os.environ.get("REPLICA_GROUP_ID", -1)),
        "rank": int(os.environ.get("RANK", -1)),
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **fields,
    }
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())  # one write per line: no interleaving
    finally:
        os.close(fd)


def worker(a: argparse.Namespace) -> None:
    _emit(a.events, "start")
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo

    sys.path.insert(0, str(REPO))
    from examples.train import build_model, make_batch

    torch.set_num_threads(1)
    prof = PROFILES[a.profile]
    group = int(os.environ["REPLICA_GROUP_ID"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    dist.init_process_group("gloo", timeout=timedelta(seconds=prof["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(a.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=prof["timeout_s"])),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"group{group}",
        timeout=timedelta(seconds=prof["timeout_s"]),
        quorum_timeout=timedelta(seconds=prof["quorum_timeout_s"]),
        connect_timeout=timedelta(seconds=prof["connect_timeout_s"]),
        heartbeat_interval=timedelta(milliseconds=prof["heartbeat_interval_ms"]),
    )
    _emit(a.events, "ready")
    params = list(model.parameters())

    def grad(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None  # every parameter takes part in the loss
        return p.grad

    while manager.current_step() < a.steps:
        step = manager.current_step()
        if restart == 0 and group == a.kill_group and rank == 0 and step == a.kill_at:
            _emit(a.events, "fault_injected", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        manager.start_quorum()
        opt.zero_grad()
        x, y = make_batch(a.seed, step, group * world + rank)  # the same shard as resild's global rank
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        flat = torch.cat([grad(p).reshape(-1) for p in params])
        dist.all_reduce(flat)  # inside the group
        flat /= world
        manager.allreduce(flat).wait()  # across groups (averaged over the groups taking part)
        off = 0
        for p in params:
            n = p.numel()
            grad(p).copy_(flat[off : off + n].view_as(p))
            off += n
        if manager.should_commit():
            opt.step()
            sched.step()
            _emit(a.events, "step", step=manager.current_step(), participants=manager.num_participants())
    _emit(a.events, "done", step=manager.current_step())
    manager.shutdown(wait=False)
    dist.destroy_process_group()


# ---- orchestrator -------------------------------------------------------------------------
def run_torchft(
    profile: str, groups: int, ppn: int, steps: int, kill_at: int, workdir: Path, timeout_s: float, seed: int = 0
) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    sys.path.insert(0, str(REPO))  # as run_resild_side: `bench` importable when run as a script
    from bench.commands import torchrun

    prof = PROFILES[profile]
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    kw = dict(
        bind="[::]:0", min_replicas=1, join_timeout_ms=prof["join_timeout_ms"], quorum_tick_ms=prof["quorum_tick_ms"]
    )
    if prof["heartbeat_timeout_ms"] is not None:
        kw["heartbeat_timeout_ms"] = prof["heartbeat_timeout_ms"]
    lighthouse = LighthouseServer(**kw)
    procs, logs = [], []
    t_launch = time.time()
    try:
        for g in range(groups):
            env = {
                **os.environ,
                "TORCHFT_LIGHTHOUSE": lighthouse.address(),
                "REPLICA_GROUP_ID": str(g),
                "NUM_REPLICA_GROUPS": str(groups),
                "OMP_NUM_THREADS": "1",
                # torch 2.13's torchrun restart reads stale addresses from a shared store without it
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            }
            log = open(workdir / f"group{g}.log", "wb")
            logs.append(log)
            cmd = torchrun(
                str(HERE),
                "--worker",
                "--events",
                str(events),
                "--steps",
                str(steps),
                "--kill-at",
                str(kill_at),
                "--kill-group",
                str(groups - 1),
                "--profile",
                profile,
                "--seed",
                str(seed),
                nproc_per_node=ppn,
                max_restarts=3,
                monitor_interval=0.1,
            )
            procs.append(
                subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        deadline = time.monotonic() + timeout_s
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        codes = [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for log in logs:
            log.close()
        lighthouse.shutdown()
    res = analyze_torchft(_read(events), groups)
    res.update(
        system=f"torchft ({profile})",
        exit_codes=codes,
        timed_out=timed_out,
        wall_s=time.time() - t_launch,
        workdir=str(workdir),
        settings=prof,
    )
    return res


def _read(path: Path) -> list[dict[str, Any]]:
    return sorted(read_events(path), key=lambda e: e["t_wall"])


def analyze_torchft(events: list[dict[str, Any]], groups: int) -> dict[str, Any]:
    res: dict[str, Any] = dict.fromkeys(
        (
            "training_again_s",
            "full_strength_s",
            "steps_reduced",
            "steps_redone",
            "lost_s",
            "goodput",
            "step_time_s",
            "steps",
        )
    )
    steps = [e for e in events if e["event"] == "step" and e["rank"] == 0]
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    if not steps:
        return res
    # One record per commit: the groups' rank 0s report each step together (it needs them all),
    # so a repeat of the previous step is the same commit; a lower step after a fault is a rollback.
    commits: list[dict[str, Any]] = []
    for e in sorted(steps, key=lambda e: e["t_wall"]):
        if not commits or e["step"] != commits[-1]["step"]:
            commits.append(e)
    t_fault = fault["t_wall"] if fault else None
    before = [e for e in commits if t_fault is None or e["t_wall"] < t_fault]
    # Failure-free step time: consecutive full-strength commits, before and after the recovery
    # (the machine's load changes over a run; one side of the fault alone would be biased).
    full = [
        b["t_wall"] - a["t_wall"]
        for a, b in zip(commits, commits[1:])
        if b["step"] == a["step"] + 1
        and a["participants"] == b["participants"] == groups
        and (t_fault is None or not a["t_wall"] < t_fault < b["t_wall"])
    ]
    res["step_time_s"] = statistics.median(full) if full else None
    res["steps"] = commits[-1]["step"]
    if t_fault is not None:
        after = [e for e in commits if e["t_wall"] > t_fault]
        if after:
            res["training_again_s"] = after[0]["t_wall"] - t_fault
            back = next((e for e in after if e["participants"] == groups), None)  # the first at full strength
            res["full_strength_s"] = back["t_wall"] - t_fault if back else None
            res["steps_reduced"] = sum(
                1 for e in after if e["participants"] < groups and (back is None or e["t_wall"] < back["t_wall"])
            )
        committed_at_fault = max((e["step"] for e in before), default=0)
        resumed_from = min((e["step"] for e in after), default=committed_at_fault + 1) - 1
        res["steps_redone"] = max(0, committed_at_fault - resumed_from)
    if res["step_time_s"] and res["training_again_s"] is not None:
        # Full-strength seconds of training lost: the stall, plus the samples the missing group
        # did not train while the others went on (a GPU does not speed up when its peers are
        # gone; on this oversubscribed CPU machine the survivors do, which inflates goodput).
        deficit = sum(1 - e["participants"] / groups for e in commits if e["t_wall"] > t_fault)
        res["lost_s"] = (
            res["training_again_s"] + deficit * res["step_time_s"] + (res["steps_redone"] or 0) * res["step_time_s"]
        )
    if res["step_time_s"] and len(commits) > 1:
        window = commits[-1]["t_wall"] - commits[0]["t_wall"]
        work = sum(e["participants"] / groups for e in commits[1:]) * res["step_time_s"]
        res["goodput"] = work / window if window > 0 else None  # > 1 would show the median is off
    return res


def run_resild_side(ppn: int, steps: int, kill_at: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from bench.recovery import run_resild

    r = run_resild(2 * ppn, ppn, steps, kill_at, workdir, timeout_s)
    # resild's spare holds exactly the failed node's ranks: back to training = back to full strength.
    return {
        "system": "resild (1 hot spare)",
        "training_again_s": r.get("total_s"),
        "full_strength_s": r.get("total_s"),
        "steps_reduced": 0,
        "steps_redone": r.get("steps_redone"),
        "lost_s": (
            r["total_s"] + (r.get("steps_redone") or 0) * (r.get("step_time_s") or 0.0)
            if r.get("total_s") is not None
            else None
        ),
        "goodput": r.get("goodput"),
        "step_time_s": r.get("step_time_s"),
        "steps": r.get("steps_completed"),
        "exit_codes": [r.get("exit_code")],
        "timed_out": r.get("timed_out"),
        "wall_s": r.get("wall_s"),
        "workdir": str(workdir),
    }


COLS = ("training_again_s", "full_strength_s", "steps_reduced", "steps_redone", "lost_s", "goodput", "step_time_s")


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--events", help=argparse.SUPPRESS)
    p.add_argument("--kill-group", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--profile",
        choices=[*PROFILES, "both"],
        default="both",
        help="torchft settings: its documented ones, tuned down, or both (default)",
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=130)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks per node (= per torchft replica group)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--only", choices=("resild", "torchft"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    try:
        import torchft  # noqa: F401
    except ImportError:
        print(
            "peers_torchft: torchft is not installed: pip install 'torchft==0.2.0' (the bench extra)", file=sys.stderr
        )
        return 2
    import tempfile

    wd = a.workdir or Path(tempfile.mkdtemp(prefix="resild-peers-"))
    profiles = list(PROFILES) if a.profile == "both" else [a.profile]
    rows: list[dict[str, Any]] = []
    for i in range(a.runs):
        if a.only != "torchft":
            rows.append(run_resild_side(a.nproc_per_node, a.steps, a.kill_at, wd / f"resild-{i}", a.timeout))
        if a.only != "resild":
            for prof in profiles:
                rows.append(
                    run_torchft(
                        prof, 2, a.nproc_per_node, a.steps, a.kill_at, wd / f"torchft-{prof}-{i}", a.timeout, a.seed
                    )
                )
    # Ratios resild / peer per run (medians over runs).
    med: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        med.setdefault(r["system"], {k: [] for k in COLS})
        for k in COLS:
            if isinstance(r.get(k), (int, float)):
                med[r["system"]][k].append(float(r[k]))
    summary: dict[str, dict[str, Any]] = {
        s: {k: (statistics.median(v) if v else None) for k, v in d.items()} for s, d in med.items()
    }
    rs = summary.get("resild (1 hot spare)")
    ratios = {}
    if rs:
        for s, d in summary.items():
            if s.startswith("torchft") and d.get("full_strength_s") and rs.get("full_strength_s"):
                ratios[s] = {
                    "full_strength": rs["full_strength_s"] / d["full_strength_s"],
                    "lost": rs["lost_s"] / d["lost_s"] if rs.get("lost_s") and d.get("lost_s") else None,
                    "training_again": (
                        rs["training_again_s"] / d["training_again_s"] if d.get("training_again_s") else None
                    ),
                }
    if a.json:
        print(json.dumps({"runs": rows, "medians": summary, "ratios_resild_over_peer": ratios}, indent=1))
        return 0
    print(f"{'system':<24}" + "".join(f"{c:>17}" for c in COLS) + f"{'exit':>10}")
    for r in rows:
        print(
            f"{r['system']:<24}"
            + "".join(f"{_fmt(r.get(c)):>17}" for c in COLS)
            + f"{','.join(map(str, r.get('exit_codes') or [])):>10}"
        )
    for s, q in ratios.items():
        print(
            f"resild / {s}: fault -> full strength {q['full_strength']:.3f}x"
            + (f", work lost {q['lost']:.3f}x" if q["lost"] else "")
            + (f", fault -> training again {q['training_again']:.3f}x" if q["training_again"] else "")
        )
    print(f"(logs and events under {wd})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
