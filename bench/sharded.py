"""Sharded and wrapped models under resild (issue 7, "Measured"): step-time overhead and HSDP recovery.

Part 1, failure-free overhead. The same training loop (``bench/sharded_train.py``: the
models, data and loops of ``examples/train_ddp_amp.py`` and ``examples/train_hsdp.py``)
runs under resild and under plain ``torchrun`` (gloo default group, ``init_device_mesh``,
``scaler.step`` / ``opt.step`` called directly), side by side in one invocation:

    resild: resil-run --local --nodes NPROC/PPN+SPARES --spares SPARES --nproc-per-node PPN \\
                -- python bench/sharded_train.py --mode resild --model M --times FILE
    plain:  torchrun --standalone --nproc-per-node NPROC \\
                bench/sharded_train.py --mode plain --model M --times FILE

for ``M`` in ddp (DDP + float16 autocast + GradScaler + 4 accumulation micro-steps +
clipping) and hsdp (FSDP2 over a 2 x NPROC/2 replicate x shard mesh + clipping + a
stateful loader). Rank 0 times every step inside the script; a run's step time is the
median over steps ``--warmup`` .. ``--steps``-1. The runs alternate, ABBA per model
(resild, plain, plain, resild, ...), so a drift in the machine's load hits both sides
alike. ``ratio`` = resild / plain of the medians of the run medians; ``commit_ms`` is the
median time of ``job.commit()`` (vote + optimizer step) or of the plain optimizer step.
By default resild runs with no spare node (``--spares``): the warm spare's processes
would sit on the same two cores here, not on a node of their own.

Part 2, HSDP fault. ``resil-run --local --nodes FAULT_NODES --spares 1 --nproc-per-node PPN
--inject kill:node1@KILL_AT`` on the hsdp loop (default 3 nodes x 2 ranks: 4 active ranks,
2 replicas x 2 shards; node1 holds replica 1). From the event file:
fault → first full-strength committed step (``total_s``, split as in ``bench/recovery.py``),
the replay of each of the spare's ranks (``state_replayed``: bytes, seconds, sources,
MB/s), compared with (i) the target *0.3 s + one step* (the run's failure-free step time,
rank 0's median) and (ii) a plain loopback copy of the same number of bytes: a gloo
send/recv of a uint8 tensor between two processes on 127.0.0.1 (``--mode loopback``,
warm connection, median of 20). ``vs_loopback`` = replay seconds / loopback seconds.
The spare's own phases after it is given ranks (``--phases`` marks of the worker: init
returns, ``job.hsdp_mesh``, model, ``fully_shard``, AdamW + loader, ``job.attach``, and its
first step: forward + backward, clipping, commit) show where its part of the recovery goes.
``--prewarm`` makes the worker import ``torch._dynamo`` before ``launcher.init()`` (the
runtime now does so itself while a spare waits). ``--compare-warmup`` runs each fault run
twice, the waiting spare's warm-up for the job's sharded state off (``RESILD_SPARE_WARMUP=0``)
and on (``launcher/worker/spare/warmup.py``), alternating ABBA, and prints both side by side
with ratios; ``spare_warmup_s`` is the warm-up's own time, spent while the spare waited.

Usage::

    .venv/bin/python bench/sharded.py                   # both parts, a table (~9 min on 2 busy cores)
    .venv/bin/python bench/sharded.py --repeats 5 --json
    .venv/bin/python bench/sharded.py --only overhead --models hsdp
    .venv/bin/python bench/sharded.py --only fault --fault-runs 3 --fault-nodes 5   # 8 ranks, 2 x 4
    .venv/bin/python bench/sharded.py --only fault --prewarm
    .venv/bin/python bench/sharded.py --only fault --compare-warmup --fault-runs 4 --no-loopback
    .venv/bin/python bench/sharded.py --only fault --compare-warmup --fault-model tp --no-loopback

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import repeated, resil_run, torchrun
from bench.common import median, phase_table, read_events, select
from bench.recovery import _parse_summary, analyze_resild

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "sharded_train.py"
TARGET_OVERHEAD = 0.05  # resild/plain - 1 (issue 17)
TARGET_BASE_S = 0.3  # fault → full strength within 0.3 s + one step

FAULT_COLS = (
    "detect_s",
    "fence_s",
    "announce_s",
    "notify_s",
    "reform_s",
    "replay_s",
    "recover_s",
    "first_step_s",
    "total_s",
    "step_s",
    "target_s",
    "within_target",
    "steps_redone",
    "exit_code",
)


Emit = Callable[[dict[str, Any]], None]  # one result record out (a JSON line or nothing)


# ---- running things --------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return env


def _run(
    cmd: list[str], workdir: Path, timeout_s: float, interrupt: int = signal.SIGINT, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``cmd`` in its own session; stdout to the caller, stderr to workdir/log.txt."""
    log_path = workdir / "log.txt"
    t0 = time.time()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env or _env(), stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(interrupt)
            try:
                out, _ = proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
    return {
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "wall_s": time.time() - t0,
        "stdout": out.decode(errors="replace"),
        "log": str(log_path),
        "command": cmd,
    }


def resild_cmd(
    model: str,
    nproc: int,
    ppn: int,
    spares: int,
    steps: int,
    times: Path,
    events: Path,
    run_dir: Path,
    inject: Sequence[str] = (),
    worker_extra: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    if nproc % ppn:
        raise ValueError(f"{nproc} ranks are not a multiple of {ppn} per node")
    worker = [python, str(WORKER), "--mode", "resild", "--model", model, "--steps", str(steps), "--times", str(times)]
    return resil_run(
        "--json",
        "-q",
        "--run-dir",
        str(run_dir),
        "--events",
        str(events),
        *repeated("--inject", inject),
        nodes=nproc // ppn + spares,
        spares=spares,
        nproc_per_node=ppn,
        worker=[*worker, *worker_extra],
        python=python,
    )


def plain_cmd(model: str, nproc: int, steps: int, times: Path, python: str = sys.executable) -> list[str]:
    worker = [str(WORKER), "--mode", "plain", "--model", model, "--steps", str(steps), "--times", str(times)]
    return torchrun(*worker, nproc_per_node=nproc, python=python)


def step_stats(times_path: Path, warmup: int) -> dict[str, Any]:
    """Rank 0's per-step times: medians over steps >= warmup (consecutive steps only)."""
    try:
        rows = json.loads(Path(times_path).read_text())["steps"]
    except (OSError, ValueError, KeyError):
        return {"step_s": None, "commit_s": None, "compute_s": None, "n_steps": 0}
    by_step = {int(r[0]): r for r in rows}
    iv, commit, compute = [], [], []
    for k in sorted(by_step):
        if k < warmup or k - 1 not in by_step:
            continue
        _, t_top, t_commit, t_end = by_step[k]
        iv.append(t_end - by_step[k - 1][3])
        commit.append(t_end - t_commit)
        compute.append(t_commit - t_top)
    return {
        "step_s": median(iv),
        "commit_s": median(commit),
        "compute_s": median(compute),
        "n_steps": len(iv),
        "intervals": iv,
    }


# ---- part 1: failure-free overhead ---------------------------------------------------------
def run_one(side: str, model: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    times = workdir / "times.json"
    times.unlink(missing_ok=True)
    if side == "resild":
        cmd = resild_cmd(
            model, args.nproc, args.ppn, args.spares, args.steps, times, workdir / "events.jsonl", workdir / "run"
        )
        r = _run(cmd, workdir, args.timeout)
        summary = _parse_summary(r["stdout"])
        r["resil_run_step_s"] = ((summary or {}).get("job") or {}).get("step_s")
    else:
        r = _run(plain_cmd(model, args.nproc, args.steps, times), workdir, args.timeout, interrupt=signal.SIGTERM)
    r.pop("stdout")
    st = step_stats(times, args.warmup)
    st.pop("intervals")
    r.update(st, side=side, model=model, workdir=str(workdir))
    return r


def overhead(args: argparse.Namespace, base: Path, emit: Emit) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):
        for model in args.models:
            order = ("resild", "plain") if i % 2 == 0 else ("plain", "resild")
            for side in order:
                if not args.json:
                    print(f"overhead: repeat {i + 1}/{args.repeats}, {model}, {side} ...", file=sys.stderr, flush=True)
                r = run_one(side, model, args, base / "overhead" / f"{model}-{side}-{i + 1}")
                r["repeat"] = i + 1
                runs.append(r)
                emit({"kind": "overhead_run", **r})
    out = []
    for model in args.models:
        rs = [r for r in runs if r["model"] == model and r["side"] == "resild"]
        pl = [r for r in runs if r["model"] == model and r["side"] == "plain"]
        row = {
            "model": model,
            "runs": args.repeats,
            "resild_ms": _ms(median(r["step_s"] for r in rs)),
            "plain_ms": _ms(median(r["step_s"] for r in pl)),
            "resild_commit_ms": _ms(median(r["commit_s"] for r in rs)),
            "plain_commit_ms": _ms(median(r["commit_s"] for r in pl)),
            "resild_compute_ms": _ms(median(r["compute_s"] for r in rs)),
            "plain_compute_ms": _ms(median(r["compute_s"] for r in pl)),
            "failed_runs": sum(1 for r in rs + pl if r["exit_code"] != 0 or r["step_s"] is None),
        }
        row["ratio"] = _div(row["resild_ms"], row["plain_ms"])
        ratios = [_div(a["step_s"], b["step_s"]) for a, b in zip(rs, pl)]
        pairs = [p for p in ratios if p is not None]
        row["pair_ratio_min"], row["pair_ratio_max"] = (min(pairs), max(pairs)) if pairs else (None, None)
        row["within_5pct"] = None if row["ratio"] is None else row["ratio"] <= 1 + TARGET_OVERHEAD
        out.append(row)
        emit({"kind": "overhead", **row})
    return out


# ---- part 2: HSDP fault → full strength ------------------------------------------------------
def fault_run(args: argparse.Namespace, workdir: Path, warmup: bool = True) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    times, events, phases = workdir / "times.json", workdir / "events.jsonl", workdir / "phases"
    for p in (times, events, *phases.glob("phases-*.json")):
        p.unlink(missing_ok=True)
    phases.mkdir(exist_ok=True)
    nproc = (args.fault_nodes - 1) * args.ppn
    cmd = resild_cmd(
        args.fault_model,
        nproc,
        args.ppn,
        1,
        args.fault_steps,
        times,
        events,
        workdir / "run",
        inject=[f"kill:node1@{args.kill_at}"],
        worker_extra=["--phases", str(phases), *(["--prewarm"] if args.prewarm else [])],
    )
    env = _env()
    env["RESILD_SPARE_WARMUP"] = "1" if warmup else "0"
    r = _run(cmd, workdir, args.timeout, env=env)
    summary = _parse_summary(r.pop("stdout"))
    evs = read_events(events)
    res = analyze_resild(evs, summary, fault_node="local-node1")
    st = step_stats(times, args.warmup)
    # one failure-free step: rank 0's median, leaving out the steps around the fault
    k = res.get("fault_step")
    iv_ok = (
        []
        if k is None
        else [t for t in _intervals_by_step(times) if t[0] >= args.warmup and not k - 1 <= t[0] <= k + 3]
    )
    res["step_s"] = median(x for _, x in iv_ok) or st["step_s"]
    res["resil_run_step_s"] = res.pop("step_time_s", None)
    if res.get("total_s") is not None and res["step_s"] is not None:
        res["target_s"] = TARGET_BASE_S + res["step_s"]
        res["within_target"] = res["total_s"] <= res["target_s"]
    else:
        res["target_s"] = res["within_target"] = None
    ep = res.get("epoch")
    res["replays"] = [
        {
            "rank": e.get("rank"),
            "bytes": int(e["bytes"]),
            "seconds": float(e["seconds"]),
            "sources": e.get("sources"),
            "mb_per_s": e.get("mb_per_s"),
            "prepared": e.get("prepared"),  # its source walked and packed it while the groups formed
        }
        for e in select(evs, "state_replayed")
        if ep is not None and e.get("epoch") == ep
    ]
    res.update(spare_phases(evs, phases, {p["rank"] for p in res["replays"]}))
    res.update(
        warmup=warmup,
        nproc=nproc,
        nodes=args.fault_nodes,
        ppn=args.ppn,
        kill_at=args.kill_at,
        steps=args.fault_steps,
        exit_code=r["exit_code"],
        timed_out=r["timed_out"],
        wall_s=r["wall_s"],
        workdir=str(workdir),
        command=r["command"],
    )
    return res


#: the spare's ranks after spare_assigned, from their --phases marks (time.monotonic(), the
#: events' t_mono clock): launcher.init returns (world group formed), job.hsdp_mesh (mesh
#: groups formed), model built, fully_shard, AdamW + loader, job.attach returns (redundancy
#: set-up, agree, replay, restore), and the first step: forward + backward, clipping, commit
SPARE_PHASES = (
    ("spare_init_s", "assigned", "init"),
    ("spare_mesh_s", "init", "mesh"),
    ("spare_model_s", "mesh", "model"),
    ("spare_shard_s", "model", "sharded"),
    ("spare_optim_s", "sharded", "built"),
    ("spare_attach_s", "built", "attached"),
    ("spare_fwd_bwd_s", "attached", "first_backward"),
    ("spare_clip_s", "first_backward", "first_clip"),
    ("spare_commit_s", "first_clip", "first_commit"),
    ("spare_total_s", "assigned", "first_commit"),
)


def spare_phases(evs: list[dict[str, Any]], phases_dir: Path, ranks: set[int]) -> dict[str, Any]:
    """Where the spare's ranks spent the recovery (the slowest rank's figure per phase)."""
    out: dict[str, Any] = dict.fromkeys(
        [name for name, _, _ in SPARE_PHASES] + ["spare_warmup_s", "spare_warmup_error"]
    )
    out["spare_warmed_ranks"] = 0
    assigned = select(evs, "spare_assigned")
    if not assigned or not ranks:
        return out
    t_a = assigned[0]["t_mono"]
    marks = []
    for f in Path(phases_dir).glob("phases-*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if d.get("rank") in ranks and d["marks"].get("init", 0) >= t_a:
            marks.append(dict(d["marks"], assigned=t_a))
    for name, a, b in SPARE_PHASES:
        vals = [m[b] - m[a] for m in marks if a in m and b in m]
        out[name] = max(vals) if vals else None
    warmed = [e for e in select(evs, "spare_warmed") if e["t_mono"] < t_a]  # while it waited
    out["spare_warmup_s"] = max((float(e["seconds"]) for e in warmed if "seconds" in e), default=None)
    out["spare_warmup_error"] = next((e["error"] for e in warmed if e.get("error")), None)
    out["spare_warmed_ranks"] = sum(1 for e in warmed if not e.get("error"))
    return out


def _intervals_by_step(times_path: Path) -> list[tuple[int, float]]:
    try:
        rows = json.loads(Path(times_path).read_text())["steps"]
    except (OSError, ValueError, KeyError):
        return []
    by = {int(r[0]): r[3] for r in rows}
    return [(k, by[k] - by[k - 1]) for k in sorted(by) if k - 1 in by]


def loopback(nbytes: int, iters: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    times = workdir / "loopback.json"
    times.unlink(missing_ok=True)
    env = _env()
    env["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1
    worker = [str(WORKER), "--mode", "loopback", "--nbytes", str(nbytes), "--iters", str(iters), "--times", str(times)]
    cmd = torchrun(*worker, nproc_per_node=2)
    r = _run(cmd, workdir, timeout_s, interrupt=signal.SIGTERM, env=env)
    try:
        secs = json.loads(times.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        secs = []
    s = median(secs)
    return {
        "nbytes": nbytes,
        "iters": len(secs),
        "seconds": s,
        "min_s": min(secs) if secs else None,
        "mb_per_s": nbytes / 1e6 / s if s else None,
        "exit_code": r["exit_code"],
    }


def fault(args: argparse.Namespace, base: Path, emit: Emit) -> dict[str, Any]:
    runs = []
    # --compare-warmup: each run is a pair, the spare's warm-up off and on, ABBA across runs
    plan = []
    for i in range(args.fault_runs):
        sides = ((False, True) if i % 2 == 0 else (True, False)) if args.compare_warmup else (not args.no_warmup,)
        plan += [(i + 1, w) for w in sides]
    for n, (i, warm) in enumerate(plan):
        if not args.json:
            print(
                f"fault: run {n + 1}/{len(plan)}, {args.fault_model}, {args.fault_nodes} nodes x {args.ppn} (1 spare), "
                f"kill:node1@{args.kill_at}, spare warm-up {'on' if warm else 'off'} ...",
                file=sys.stderr,
                flush=True,
            )
        r = fault_run(args, base / "fault" / f"run{i}-{'warm' if warm else 'cold'}", warmup=warm)
        r["run"] = n + 1
        runs.append(r)
        emit({"kind": "fault_run", **r})
    replays = [p for r in runs for p in r["replays"]]
    nbytes = median(p["bytes"] for p in replays)
    lb = None
    if nbytes and not args.no_loopback:
        if not args.json:
            print(f"loopback: gloo send/recv of {int(nbytes)} bytes ...", file=sys.stderr, flush=True)
        lb = loopback(int(nbytes), 20, base / "loopback", args.timeout)
        emit({"kind": "loopback", **lb})
    for p in replays:
        p["vs_loopback"] = _div(p["seconds"], lb and lb["seconds"])
    med = {
        k: median(r.get(k) for r in runs if isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool))
        for k in FAULT_COLS
        if k != "within_target"
    }
    out = {
        "runs": runs,
        "median": med,
        "loopback": lb,
        "replay_bytes_per_rank": nbytes,
        "replay_s_per_rank": median(p["seconds"] for p in replays),
        "replay_mb_per_s": median(p["bytes"] / 1e6 / p["seconds"] for p in replays if p["seconds"] > 0),
        "replay_sources": sorted({len(p["sources"] or []) for p in replays}),
        "replays_prepared": sum(1 for p in replays if p.get("prepared")),
        "replays": len(replays),
        "runs_within_target": sum(1 for r in runs if r.get("within_target")),
    }
    out["replay_vs_loopback"] = _div(out["replay_s_per_rank"], lb and lb["seconds"])
    # "warmed": the warm runs whose spare ranks had all finished their warm-up before the fault
    # (a fault during it waits for the part under way: the bench's early fault can land there)
    pick: dict[str, Callable[[dict[str, Any]], Any]] = {
        "cold": lambda r: not r["warmup"],
        "warm": lambda r: r["warmup"],
        "warmed": lambda r: r["warmup"] and r.get("spare_warmed_ranks", 0) >= args.ppn,
    }
    out["sides"] = {
        side: {
            k: median(r.get(k) for r in runs if sel(r) and _num(r.get(k)))
            for k in (*FAULT_COLS, *SPARE_COLS)
            if k != "within_target"
        }
        | {
            "runs": sum(1 for r in runs if sel(r)),
            "within_target": sum(1 for r in runs if sel(r) and r.get("within_target")),
        }
        for side, sel in pick.items()
        if any(sel(r) for r in runs)
    }
    emit({"kind": "fault", **{k: v for k, v in out.items() if k != "runs"}})
    return out


# ---- output ------------------------------------------------------------------------------
SPARE_COLS = (*(n for n, _, _ in SPARE_PHASES), "spare_warmup_s", "spare_warmed_ranks")


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def _div(a: object, b: object) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def _yn(v: object) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def print_overhead(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(
        f"\nfailure-free step time, {args.nproc} ranks, gloo on CPU, rank 0's median over steps "
        f"{args.warmup}..{args.steps - 1}, {args.repeats} runs per side (ABBA); ms"
    )
    print(
        f"resild: resil-run --local {args.nproc // args.ppn} nodes x {args.ppn}, {args.spares} spare(s); "
        f"plain: torchrun --nproc-per-node {args.nproc}"
    )
    cols = (
        "resild_ms",
        "plain_ms",
        "ratio",
        "pair_ratio_min",
        "pair_ratio_max",
        "resild_commit_ms",
        "plain_commit_ms",
        "resild_compute_ms",
        "plain_compute_ms",
        "within_5pct",
        "failed_runs",
    )
    conv = [{k: (_yn(v) if isinstance(v, bool) else v) for k, v in r.items()} for r in rows]
    print(_no_median(phase_table(conv, cols, label="model", digits=3)))


def _no_median(t: str) -> str:
    return "\n".join(line for line in t.splitlines() if not line.lstrip().startswith("median"))


def print_fault(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(
        f"\nHSDP fault: resil-run --local {args.fault_nodes} nodes x {args.ppn} (1 spare; "
        f"{(args.fault_nodes - 1) * args.ppn} ranks, 2 replicas x {(args.fault_nodes - 1) * args.ppn // 2} shards), "
        f"SIGKILL of node1's worker 0 at step {args.kill_at}"
        f"{', --prewarm' if args.prewarm else ''}; seconds"
    )
    conv = [
        {k: (("on" if v else "off") if k == "warmup" else _yn(v) if isinstance(v, bool) else v) for k, v in r.items()}
        for r in res["runs"]
    ]
    print(phase_table(conv, ("warmup", *FAULT_COLS), digits=3))
    print(
        "total_s = detect + fence + announce + notify + recover (re-form, agree, replay) + first_step; "
        f"target_s = {TARGET_BASE_S:g} + step_s (rank 0's failure-free median)"
    )
    print(
        "\nthe spare's ranks from spare_assigned (slowest rank): init = launcher.init returns, mesh = "
        "job.hsdp_mesh, build = model + fully_shard + AdamW + loader, attach = job.attach (agree, replay, "
        "restore), first_commit = its first step"
    )
    print(phase_table(conv, ["warmup", *SPARE_COLS], digits=3))
    sides = res.get("sides") or {}
    if "cold" in sides and "warm" in sides:
        cold, warm = sides["cold"], sides["warm"]
        warmed = sides.get("warmed", {})
        print(
            "\nside by side (medians; ratio = warm / cold; warmed = the warm runs whose spare had "
            "finished its warm-up before the fault)"
        )
        rows = [
            {
                "": k,
                "cold": cold.get(k),
                "warm": warm.get(k),
                "ratio": _div(warm.get(k), cold.get(k)),
                "warmed": warmed.get(k),
                "warmed_ratio": _div(warmed.get(k), cold.get(k)),
            }
            for k in ("total_s", "first_step_s", "recover_s", *SPARE_COLS, "step_s", "target_s")
        ]
        print(_no_median(phase_table(rows, ("cold", "warm", "ratio", "warmed", "warmed_ratio"), label="", digits=3)))
        print("within target: " + ", ".join(f"{k} {v['within_target']} of {v['runs']}" for k, v in sides.items()))
    print("\nreplay to the spare's ranks (state_replayed), vs a gloo send/recv of the same bytes on 127.0.0.1")
    rows = [{"run": r["run"], **p} for r in res["runs"] for p in r["replays"]]
    for p in rows:
        p["rank"] = str(p["rank"])
        p["sources"] = "ranks " + ",".join(str(s) for s in p.get("sources") or [])
        p["mb"] = p["bytes"] / 1e6
    if rows:
        print(phase_table(rows, ("rank", "mb", "seconds", "mb_per_s", "sources", "vs_loopback"), digits=4))
    else:
        print("(no state_replayed event)")
    lb = res["loopback"]
    if lb:
        print(
            f"loopback: {lb['nbytes']} bytes in {lb['seconds']:.4f} s (median of {lb['iters']}, min "
            f"{lb['min_s']:.4f} s) = {lb['mb_per_s']:.0f} MB/s"
        )
    m = res["median"]
    if m.get("total_s") is not None:
        print(
            f"\nmedians: fault → full strength {m['total_s']:.3f} s (target {m['target_s']:.3f} s = "
            f"{TARGET_BASE_S:g} + one step {m['step_s'] * 1000:.0f} ms; met in {res['runs_within_target']} of "
            f"{len(res['runs'])}); replay {res['replay_bytes_per_rank'] / 1e6:.2f} MB per failed rank in "
            f"{res['replay_s_per_rank']:.4f} s = {res['replay_mb_per_s']:.0f} MB/s"
            + (f", {res['replay_vs_loopback']:.1f}x the loopback copy's time" if res["replay_vs_loopback"] else "")
            + f"; {res['replays_prepared']} of {res['replays']} from a source prepared while the groups formed"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="DDP and FSDP2 HSDP under resild: step-time overhead vs torchrun, HSDP recovery",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Usage::")[1],
    )
    p.add_argument("--only", choices=("overhead", "fault"), help="run one part")
    p.add_argument("--models", default="ddp,hsdp", help="overhead: comma-separated, of ddp,hsdp")
    p.add_argument("--repeats", type=int, default=3, help="overhead: runs per side and model")
    p.add_argument("--steps", type=int, default=150, help="overhead: steps per run")
    p.add_argument("--warmup", type=int, default=30, help="steps left out of the step-time median")
    p.add_argument("--nproc", type=int, default=4, help="overhead: ranks")
    p.add_argument("--ppn", type=int, default=2, help="resild: ranks per simulated node")
    p.add_argument("--spares", type=int, default=0, help="overhead: resild's hot spare nodes")
    p.add_argument("--fault-runs", type=int, default=2)
    p.add_argument("--fault-nodes", type=int, default=3, help="fault: nodes incl. the one spare (3: 4 ranks)")
    p.add_argument("--fault-steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=60)
    p.add_argument(
        "--prewarm",
        action="store_true",
        help="fault: the worker imports torch._dynamo before "
        "launcher.init, so a spare does not pay fully_shard's first-call import after taking over",
    )
    p.add_argument(
        "--compare-warmup",
        action="store_true",
        help="fault: each run twice, the waiting spare's warm-up off (RESILD_SPARE_WARMUP=0) and on, ABBA",
    )
    p.add_argument("--no-warmup", action="store_true", help="fault: the spare does not warm up (as before)")
    p.add_argument(
        "--fault-model",
        choices=("hsdp", "tp"),
        default="hsdp",
        help="fault: hsdp (replayed from a replica) or tp (FSDP2 + tensor parallelism, 2 ranks per TP "
        "group: rolled back to a peer-memory snapshot)",
    )
    p.add_argument("--no-loopback", action="store_true", help="fault: skip the loopback yardstick")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="one JSON object per line (runs, then summaries)")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    if any(m not in ("ddp", "hsdp") for m in args.models):
        p.error("--models: ddp and/or hsdp")
    if args.nproc % args.ppn or (args.nproc // args.ppn) < 1:
        p.error("--nproc must be a multiple of --ppn")
    if args.warmup >= args.steps - 1:
        p.error("--warmup must leave steps to measure")
    if not 0 < args.kill_at < args.fault_steps:
        p.error("--kill-at must be inside (0, --fault-steps)")
    if args.fault_nodes < 3:
        p.error("--fault-nodes: at least 3 (2 active replicas + 1 spare)")

    base = args.workdir or Path(tempfile.mkdtemp(prefix="resild-sharded-"))

    def emit(obj: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(obj), flush=True)

    ok = True
    ov = fr = None
    if args.only in (None, "overhead"):
        ov = overhead(args, base, emit)
        ok &= all(r["failed_runs"] == 0 for r in ov)
    if args.only in (None, "fault"):
        fr = fault(args, base, emit)
        ok &= all(r["exit_code"] == 0 for r in fr["runs"])
    if not args.json:
        if ov is not None:
            print_overhead(args, ov)
        if fr is not None:
            print_fault(args, fr)
        print(f"\nevents, times and logs under {base}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
