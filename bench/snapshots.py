"""Peer-memory snapshots of plain FSDP2 (issue 16, "Measured"): their cost, and the rollback.

Plain FSDP2 (ZeRO-3) keeps no replica of a rank's shard: resild protects it by snapshots.
After a commit every rank freezes its local state (parameter and optimizer shards, RNG,
scheduler, loader position) into host memory and, in a background thread, sends
``--snapshot-copies K`` copies to ranks on the next nodes, every ``--snapshot-every N``
commits; after a node loss every rank rolls back to the newest snapshot complete for all.
The loop is ``examples/train_fsdp.py``'s (``bench/sharded_train.py --model fsdp``: the
model, data and loop of the example; FSDP2 ``fully_shard`` per Linear and on the root
over a 1-D mesh of every rank, AdamW, CosineAnnealingLR, clipping, a stateful loader).

Part 1, failure-free overhead. The same loop, 4 ranks, side by side in one invocation:

    plain: torchrun --standalone --nproc-per-node 4 \\
               bench/sharded_train.py --mode plain --model fsdp --times FILE
    k0/k1/k2: resil-run --local --nodes 4 --spares 0 --nproc-per-node 1 \\
               --snapshot-copies K --snapshot-every EVERY --events FILE -- \\
               python bench/sharded_train.py --mode resild --model fsdp --times FILE

(``init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))`` and ``opt.step`` directly
under torchrun; ``job.mesh((4,), ("shard",))`` and ``job.commit()`` under resild). K = 2
needs three nodes, so every resild variant runs one rank per node and they compare alike;
``k0`` is resild with no snapshots (a node loss would stop the job), so ``k1 / k0`` is the
snapshots' own cost and ``k0 / plain`` the rest of resild's. Rank 0 times every step in the
script; a run's step time is the median over steps ``--warmup`` .. ``--steps``-1. The
variants alternate, ABBA (plain k0 k1 k2, then k2 k1 k0 plain, ...), ``--repeats`` times,
so a drift in the machine's load hits all of them alike; ``step_ms`` is the median of the
run medians, ``ratio`` = step_ms / plain's step_ms. From each rank's ``snapshots``
event (written before DONE; median over ranks and runs): ``taken`` / ``skipped`` snapshots
(skipped: the previous exchange was not confirmed yet), ``capture_ms`` = training-thread
seconds copying per snapshot (capture_s / taken), ``exchange_ms`` = the last exchange's
seconds (background thread), ``held_kb`` = host bytes of snapshots the rank holds at the
end (its own and the copies it keeps for others). ``state_kb`` is rank 0's own model +
optimizer tensor bytes (parameter shards and AdamW's two moments, from the script), and
``held_x`` = held / state.

Part 2, recovery of a node loss. resild: ``resil-run --local --nodes 3 --spares 1
--nproc-per-node 2 --snapshot-copies 1 --snapshot-every FAULT_EVERY --inject
kill:node1@KILL_AT`` (4 ranks; SIGKILL of node1's worker 0, rank 2, once KILL_AT steps
are committed). From the event file, through ``resild.report.recoveries`` (the analysis
resil-run's table and ``resild report`` use): fault → first full-strength committed step
(``total_s``; its phases detection, fence, re-form, replay, first step), the rollback
(``rolled_back``: step, newest, steps_redone) and the replay (``state_replayed``,
source=snapshot: bytes, seconds). torchrun: ``torchrun --standalone --nproc-per-node 4
--max-restarts 1`` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, needed for a restart in torch
2.13) on the same loop with a ``torch.distributed.checkpoint`` every ``--ckpt-every`` steps
(each rank its shards; loaded at start from the newest complete one); rank 2 SIGKILLs
itself at the top of step KILL_AT in the first attempt; torchrun stops the others and
restarts all four, which resume from the checkpoint. Its phases come from
``bench.torchrun_baseline.analyze`` (detect, restart, first_step, total = fault → the
first step after the restart committed by all four ranks). ``work_lost_s`` =
steps_redone × the run's failure-free step time (rank 0's median); ``caught_up_s`` = fault
→ the step in flight at the fault committed again (torchrun: measured; resild: total_s +
work_lost_s). ``speedup`` = torchrun total_s / resild total_s (medians), ``speedup_caught_up``
likewise. The two sides alternate (resild torchrun, torchrun resild, ...).

Part 3, disk fallback: every in-memory copy of some rank's state lost at once, so resild
loads its own newest disk checkpoint in-process. ``resil-run --local --nodes 5 --spares 2
--nproc-per-node 1 --snapshot-copies 1 --snapshot-every FAULT_EVERY --checkpoint-dir DIR
--checkpoint-every CKPT_EVERY --inject nodeloss:node0@KILL_AT --inject
nodeloss:node1@KILL_AT`` (3 active ranks; the single copy of rank 0's snapshot lives on
node1, the next node, so rank 0's own state and its only copy die together; the same loop,
no training-loop change). From the event file: the controller's failures
(``resild.report.recoveries``) and the one whose ``recovered_from`` is "checkpoint"; the
episode starts at the first of the failures that came back at full strength at the same
step (both node losses) and ends at that ``full_strength_step``: ``total_s``, split into
detection (→ the last failure detected), fence, re-form, ``load_s`` (rank 0's new group
formed → ``resumed``, source "checkpoint": agreeing on the newest checkpoint and loading
it) and first step; ``checkpoint_loaded`` gives ``ckpt_step`` and rank 0's own
``ckpt_load_s``; ``steps_redone`` = committed step at detection - the resumed step;
``work_lost_s`` = steps_redone × step time (the run's rank 0 median, which after the
fault is the spare that took rank 0 over; the steps around the fault left out);
``caught_up_s`` = total_s + work_lost_s. Side by side, part 2's torchrun baseline with
``--nproc-per-node 3``, a DCP checkpoint every CKPT_EVERY steps and rank 0 SIGKILLed at the
top of step KILL_AT: time to full strength and steps redone, ``speedup`` = torchrun /
resild (medians; ``speedup_caught_up`` likewise). The sides alternate as in part 2,
``--fault-runs`` runs each.

Usage::

    .venv/bin/python bench/snapshots.py                      # all three parts, tables (~6-9 min on 2 busy cores)
    .venv/bin/python bench/snapshots.py --quick              # fewer steps, one run of each (~2 min)
    .venv/bin/python bench/snapshots.py --json               # one JSON object
    .venv/bin/python bench/snapshots.py --only overhead --variants plain,k1 --repeats 4
    .venv/bin/python bench/snapshots.py --only recovery --kill-at 70 --ckpt-every 50 --fault-every 5
    .venv/bin/python bench/snapshots.py --only fallback --fault-runs 2

Nothing here asserts on timings: it reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.commands import torchrun
from bench.common import median, phase_table, read_events, select
from bench.sharded import _env, _intervals_by_step, _run, plain_cmd, resild_cmd, step_stats
from bench.snapshots_analysis import (
    DEFAULT_VARIANTS,
    FALLBACK_COLS,
    FALLBACK_RESILD_COLS,
    RESILD_COLS,
    TORCHRUN_COLS,
    VARIANTS,
    _num,
    fallback_recovery,
    overhead_rows,
    resild_recovery,
    snapshot_stats,
    summarize_fallback,
    summarize_recovery,
    torchrun_recovery,
)
from bench.torchrun_baseline import _kill_leftovers

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "bench" / "sharded_train.py"
MODEL = "fsdp"


OVERHEAD_COLS = (
    "runs",
    "step_ms",
    "ratio",
    "pair_ratio_min",
    "pair_ratio_max",
    "commit_ms",
    "compute_ms",
    "state_kb",
    "held_kb",
    "held_x",
    "capture_ms",
    "capture_pct",
    "exchange_ms",
    "taken",
    "skipped",
    "failed_runs",
)
#: part 3: resild's recovery from its own disk checkpoint
FALLBACK_NPROC = 3  # active ranks, one per node
FALLBACK_SPARES = 2  # two nodes are lost at once
FALLBACK_KILL_RANK = 0  # torchrun: the rank that SIGKILLs itself (resild loses ranks 0 and 1)

Say = Callable[[str], None]  # a progress line out (to stderr, or nowhere)


# ---- running things --------------------------------------------------------------------
def _with_flags(cmd: list[str], *flags: str) -> list[str]:
    """resil-run flags go before the ``--`` that starts the worker's command line."""
    i = cmd.index("--")
    return [*cmd[:i], *flags, *cmd[i:]]


def _with_snapshots(cmd: list[str], copies: int, every: int | str) -> list[str]:
    return _with_flags(cmd, "--snapshot-copies", str(copies), "--snapshot-every", str(every))


def _state_bytes(times: Path) -> int | None:
    try:
        return cast(int | None, json.loads(times.read_text()).get("state_bytes"))
    except (OSError, ValueError, AttributeError):
        return None


def overhead_run(variant: str, repeat: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    times, events = workdir / "times.json", workdir / "events.jsonl"
    for p in (times, events):
        p.unlink(missing_ok=True)
    copies = VARIANTS[variant]
    if copies is None:
        r = _run(plain_cmd(MODEL, args.nproc, args.steps, times), workdir, args.timeout, interrupt=signal.SIGTERM)
    else:
        cmd = resild_cmd(MODEL, args.nproc, 1, 0, args.steps, times, events, workdir / "run")
        every = "auto" if variant.endswith("auto") else args.every
        r = _run(_with_snapshots(cmd, copies, every), workdir, args.timeout)
    r.pop("stdout")
    st = step_stats(times, args.warmup)
    st.pop("intervals")
    r.update(st, variant=variant, repeat=repeat, workdir=str(workdir), state_bytes=_state_bytes(times))
    r["snapshots"] = snapshot_stats(read_events(events)) if copies else None
    return r


def overhead(args: argparse.Namespace, base: Path, say: Say) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for i in range(args.repeats):
        order = args.variants if i % 2 == 0 else args.variants[::-1]
        for v in order:
            say(f"overhead: repeat {i + 1}/{args.repeats}, {v} ...")
            runs.append(overhead_run(v, i + 1, args, base / "overhead" / f"{v}-{i + 1}"))
    return {"runs": runs, "rows": overhead_rows(runs, args.variants)}


def torchrun_fault_cmd(
    args: argparse.Namespace, nproc: int, workdir: Path, python: str = sys.executable, kill_rank: int | None = None
) -> list[str]:
    return torchrun(
        str(WORKER),
        "--mode",
        "plain",
        "--model",
        MODEL,
        "--steps",
        str(args.fault_steps),
        "--ckpt-dir",
        str(workdir / "ckpt"),
        "--ckpt-every",
        str(args.ckpt_every),
        "--kill-at",
        str(args.kill_at),
        "--kill-rank",
        str(args.fault_ppn if kill_rank is None else kill_rank),
        "--events",
        str(workdir / "events.jsonl"),
        "--times",
        str(workdir / "times.json"),
        nproc_per_node=nproc,
        max_restarts=1,
        monitor_interval=0.1,
        python=python,
    )


def _fresh(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    for name in ("times.json", "events.jsonl"):
        (workdir / name).unlink(missing_ok=True)
    shutil.rmtree(workdir / "ckpt", ignore_errors=True)


def resild_fault_run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    _fresh(workdir)
    nproc = (args.fault_nodes - 1) * args.fault_ppn
    times, events = workdir / "times.json", workdir / "events.jsonl"
    cmd = resild_cmd(
        MODEL,
        nproc,
        args.fault_ppn,
        1,
        args.fault_steps,
        times,
        events,
        workdir / "run",
        inject=[f"kill:node1@{args.kill_at}"],
    )
    cmd = _with_snapshots(cmd, 1, args.fault_every)
    r = _run(cmd, workdir, args.timeout)
    evs = read_events(events)
    # one failure-free step: rank 0's median, leaving out the steps around the fault
    fault = next(iter(select(evs, "fault_injected")), None)
    k = fault.get("step") if fault else None
    iv = [x for s, x in _intervals_by_step(times) if s >= args.warmup and (k is None or not k - 1 <= s <= k + 3)]
    res = resild_recovery(evs, median(iv))
    res.update(nproc=nproc, exit_code=r["exit_code"], timed_out=r["timed_out"], wall_s=r["wall_s"])
    res.update(workdir=str(workdir), command=r["command"])
    return res


def torchrun_fault_run(
    args: argparse.Namespace, workdir: Path, nproc: int | None = None, kill_rank: int | None = None
) -> dict[str, Any]:
    _fresh(workdir)
    nproc = (args.fault_nodes - 1) * args.fault_ppn if nproc is None else nproc
    env = _env()
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # else the restarted workers reuse stale addresses
    cmd = torchrun_fault_cmd(args, nproc, workdir, kill_rank=kill_rank)
    r = _run(cmd, workdir, args.timeout, interrupt=signal.SIGTERM, env=env)
    evs = read_events(workdir / "events.jsonl")
    if r["timed_out"]:
        _kill_leftovers(evs)
    res = torchrun_recovery(evs, nproc, args.kill_at)
    res.update(nproc=nproc, exit_code=r["exit_code"], timed_out=r["timed_out"], wall_s=r["wall_s"])
    res.update(workdir=str(workdir), command=r["command"])
    return res


def side_by_side(
    part: str, args: argparse.Namespace, base: Path, say: Say, runs: dict[str, Any], what: dict[str, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`args.fault_runs` runs of each side, ABBA-ordered (resild, torchrun, torchrun, resild, ...)
    so a drift in the machine's load hits both alike; `runs[side](workdir)` runs one."""
    out: dict[str, list[dict[str, Any]]] = {"resild": [], "torchrun": []}
    for i in range(args.fault_runs):
        for side in ("resild", "torchrun") if i % 2 == 0 else ("torchrun", "resild"):
            say(f"{part}: run {i + 1}/{args.fault_runs}, {side}, {what[side]} at step {args.kill_at} ...")
            out[side].append({"run": i + 1, **runs[side](base / part / f"{side}-{i + 1}")})
    return out["resild"], out["torchrun"]


def recovery(args: argparse.Namespace, base: Path, say: Say) -> dict[str, Any]:
    rs, tr = side_by_side(
        "recovery",
        args,
        base,
        say,
        {"resild": lambda wd: resild_fault_run(args, wd), "torchrun": lambda wd: torchrun_fault_run(args, wd)},
        {"resild": "kill", "torchrun": "kill"},
    )
    return {"resild": rs, "torchrun": tr, "summary": summarize_recovery(rs, tr)}


def resild_fallback_cmd(args: argparse.Namespace, workdir: Path, python: str = sys.executable) -> list[str]:
    """Part 3: 3 ranks on 5 nodes (2 spares), one snapshot copy, resild's own disk checkpoints,
    node0 and node1 (rank 0 and the node holding its only copy) lost at the same step."""
    cmd = resild_cmd(
        MODEL,
        FALLBACK_NPROC,
        1,
        FALLBACK_SPARES,
        args.fault_steps,
        workdir / "times.json",
        workdir / "events.jsonl",
        workdir / "run",
        inject=[f"nodeloss:node0@{args.kill_at}", f"nodeloss:node1@{args.kill_at}"],
        python=python,
    )
    return _with_flags(
        _with_snapshots(cmd, 1, args.fault_every),
        "--checkpoint-dir",
        str(workdir / "ckpt"),
        "--checkpoint-every",
        str(args.ckpt_every),
    )


def resild_fallback_run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    _fresh(workdir)
    r = _run(resild_fallback_cmd(args, workdir), workdir, args.timeout)
    evs = read_events(workdir / "events.jsonl")
    # one failure-free step: rank 0's median (after the fault: the spare that took rank 0
    # over, from the checkpoint on), leaving out the steps around the fault and the reload
    loaded = next((e.get("step") for e in select(evs, "checkpoint_loaded") if _num(e.get("step"))), None)
    lo = args.kill_at if loaded is None else int(loaded)
    iv = [
        x
        for s, x in _intervals_by_step(workdir / "times.json")
        if s >= args.warmup and not lo - 1 <= s <= max(lo, args.kill_at) + 3
    ]
    res = fallback_recovery(evs, median(iv))
    res.update(nproc=FALLBACK_NPROC, exit_code=r["exit_code"], timed_out=r["timed_out"], wall_s=r["wall_s"])
    res.update(workdir=str(workdir), command=r["command"])
    return res


def fallback(args: argparse.Namespace, base: Path, say: Say) -> dict[str, Any]:
    rs, tr = side_by_side(
        "fallback",
        args,
        base,
        say,
        {
            "resild": lambda wd: resild_fallback_run(args, wd),
            "torchrun": lambda wd: torchrun_fault_run(args, wd, FALLBACK_NPROC, FALLBACK_KILL_RANK),
        },
        {"resild": "node0 and node1 lost", "torchrun": f"rank {FALLBACK_KILL_RANK} killed"},
    )
    return {"resild": rs, "torchrun": tr, "summary": summarize_fallback(rs, tr)}


# ---- output ------------------------------------------------------------------------------
def _no_median(t: str) -> str:
    return "\n".join(line for line in t.splitlines() if not line.lstrip().startswith("median"))


def print_overhead(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(
        f"\nfailure-free step time, plain FSDP2, {args.nproc} ranks, gloo on CPU, rank 0's median over steps "
        f"{args.warmup}..{args.steps - 1}, {args.repeats} run(s) per variant (ABBA); snapshot every {args.every}"
    )
    print(
        f"plain: torchrun --nproc-per-node {args.nproc}; k0/k1/k2: resil-run --local --nodes {args.nproc} "
        "--nproc-per-node 1 --spares 0 --snapshot-copies 0/1/2"
    )
    print(_no_median(phase_table(res["rows"], OVERHEAD_COLS, label="variant", digits=3)))
    print(
        "ms per step; ratio = step_ms / plain's; pair_ratio: against the same repeat's plain run; "
        "state_kb: rank 0's model + optimizer shards; held_kb: snapshot bytes a rank holds at the end "
        "(median over ranks); held_x = held / state; capture_ms: training-thread copy per snapshot; "
        "capture_pct: of a step, per step"
    )


def print_recovery(args: argparse.Namespace, res: dict[str, Any]) -> None:
    nproc = (args.fault_nodes - 1) * args.fault_ppn
    print(
        f"\nnode loss, plain FSDP2, {nproc} ranks; SIGKILL of rank {args.fault_ppn} once {args.kill_at} of "
        f"{args.fault_steps} steps are committed; seconds"
    )
    print(
        f"\nresild: resil-run --local --nodes {args.fault_nodes} --spares 1 --nproc-per-node {args.fault_ppn} "
        f"--snapshot-copies 1 --snapshot-every {args.fault_every}, rollback to the newest complete snapshot"
    )
    if res["resild"]:
        print(phase_table(res["resild"], RESILD_COLS, digits=3))
    print(
        f"\ntorchrun: --nproc-per-node {nproc} --max-restarts 1, torch.distributed.checkpoint every "
        f"{args.ckpt_every} steps, restart of every worker from the newest"
    )
    if res["torchrun"]:
        print(phase_table(res["torchrun"], TORCHRUN_COLS, digits=3))
    s = res["summary"]
    rs, tr = s["resild"], s["torchrun"]
    if _num(rs.get("total_s")) and _num(tr.get("total_s")):
        print(
            f"\nmedians: fault → full strength: resild {rs['total_s']:.3f} s (rolled back to step "
            f"{rs.get('rolled_back_to')}, {rs.get('steps_redone')} step(s) redone), torchrun {tr['total_s']:.3f} s "
            f"(resumed at step {tr.get('resumed_step')}, {tr.get('steps_redone')} step(s) redone); "
            f"torchrun / resild = {s['speedup']:.1f}x"
            + (
                f"; fault → caught up: {rs['caught_up_s']:.3f} s vs {tr['caught_up_s']:.3f} s = "
                f"{s['speedup_caught_up']:.1f}x"
                if s.get("speedup_caught_up")
                else ""
            )
        )


def print_fallback(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(
        f"\ndisk fallback, plain FSDP2, {FALLBACK_NPROC} ranks; every in-memory copy of rank 0's state lost "
        f"once {args.kill_at} of {args.fault_steps} steps are committed; checkpoints every {args.ckpt_every} "
        "steps; seconds"
    )
    print(
        f"\nresild: resil-run --local --nodes {FALLBACK_NPROC + FALLBACK_SPARES} --spares {FALLBACK_SPARES} "
        f"--nproc-per-node 1 --snapshot-copies 1 --checkpoint-dir DIR --checkpoint-every {args.ckpt_every} "
        f"--inject nodeloss:node0@{args.kill_at} --inject nodeloss:node1@{args.kill_at}; its newest checkpoint "
        "loaded in-process"
    )
    if res["resild"]:
        print(phase_table(res["resild"], FALLBACK_RESILD_COLS, digits=3))
    print(
        f"\ntorchrun: --nproc-per-node {FALLBACK_NPROC} --max-restarts 1, torch.distributed.checkpoint every "
        f"{args.ckpt_every} steps, rank {FALLBACK_KILL_RANK} SIGKILLed at step {args.kill_at}, restart of every "
        "worker from the newest"
    )
    if res["torchrun"]:
        print(phase_table(res["torchrun"], TORCHRUN_COLS, digits=3))
    s = res["summary"]
    print("\nside by side (medians; the last row: torchrun / resild)")
    print(_no_median(phase_table(s["rows"], FALLBACK_COLS, label="side", digits=3)))
    rs, tr = s["resild"], s["torchrun"]
    if _num(rs.get("total_s")) and _num(tr.get("total_s")):
        print(
            f"\nmedians: fault → full strength: resild {rs['total_s']:.3f} s (checkpoint step {rs.get('ckpt_step')} "
            f"loaded in {_fmt_s(rs.get('ckpt_load_s'))}, {rs.get('steps_redone')} step(s) redone), torchrun "
            f"{tr['total_s']:.3f} s (resumed at step {tr.get('resumed_step')}, {tr.get('steps_redone')} step(s) "
            f"redone); torchrun / resild = {s['speedup']:.1f}x"
            + (
                f"; fault → caught up: {rs['caught_up_s']:.3f} s vs {tr['caught_up_s']:.3f} s = "
                f"{s['speedup_caught_up']:.1f}x"
                if s.get("speedup_caught_up")
                else ""
            )
        )


def _fmt_s(v: Any) -> str:
    return f"{v:.3f} s" if _num(v) else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Plain FSDP2 peer-memory snapshots under resild: step-time cost, node-loss recovery "
        "by rollback, and the disk fallback when every copy is lost, vs torchrun + a DCP checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(__doc__ or "").split("Usage::")[1],
    )
    p.add_argument("--only", choices=("overhead", "recovery", "fallback"), help="run one part")
    p.add_argument("--quick", action="store_true", help="fewer steps, one run of each (about 2 min)")
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"overhead: comma-separated, of {','.join(VARIANTS)} (*auto: --snapshot-every auto)",
    )
    p.add_argument("--repeats", type=int, help="overhead: runs per variant (default 2; --quick 1)")
    p.add_argument("--steps", type=int, help="overhead: steps per run (default 150; --quick 40)")
    p.add_argument("--warmup", type=int, help="steps left out of the step-time median (default 30; --quick 10)")
    p.add_argument("--nproc", type=int, default=4, help="overhead: ranks (resild: one per node)")
    p.add_argument("--every", type=int, default=1, help="overhead: --snapshot-every of k1 and k2")
    p.add_argument("--fault-runs", type=int, help="recovery, fallback: runs per side (default 2; --quick 1)")
    p.add_argument("--fault-nodes", type=int, default=3, help="recovery: resild nodes incl. the one spare")
    p.add_argument("--fault-ppn", type=int, default=2, help="recovery: ranks per node (rank PPN is killed)")
    p.add_argument("--fault-steps", type=int, help="recovery, fallback: steps per run (default 120; --quick 40)")
    p.add_argument(
        "--kill-at",
        type=int,
        help="recovery, fallback: the fault once this many steps are committed (60; --quick 25)",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        help="recovery: torchrun's DCP checkpoint every N steps; fallback: both sides' (50; --quick 10)",
    )
    p.add_argument("--fault-every", type=int, default=1, help="recovery, fallback: resild's --snapshot-every")
    p.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    p.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON object (runs, rows, summaries)")
    args = p.parse_args(argv)
    q = args.quick
    for name, full, quick in (
        ("repeats", 2, 1),
        ("steps", 150, 40),
        ("warmup", 30, 10),
        ("fault_runs", 2, 1),
        ("fault_steps", 120, 40),
        ("kill_at", 60, 25),
        ("ckpt_every", 50, 10),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants: some of {','.join(VARIANTS)}")
    if "k2" in args.variants and args.nproc < 3:
        p.error("k2 needs 3 nodes: --nproc >= 3")
    if args.warmup >= args.steps - 1:
        p.error("--warmup must leave steps to measure")
    if not 0 < args.kill_at < args.fault_steps:
        p.error("--kill-at must be inside (0, --fault-steps)")
    if args.fault_nodes < 3:
        p.error("--fault-nodes: at least 3 (2 active + 1 spare: a copy must live on another node)")
    if args.only in (None, "fallback") and not 0 < args.ckpt_every < args.kill_at:
        p.error("fallback: --ckpt-every must be under --kill-at (a checkpoint must exist when the nodes are lost)")

    base = args.workdir or Path(tempfile.mkdtemp(prefix="resild-snapshots-"))

    def say(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    out: dict[str, Any] = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    ok = True
    if args.only in (None, "overhead"):
        out["overhead"] = overhead(args, base, say)
        ok &= all(r["failed_runs"] == 0 for r in out["overhead"]["rows"])
    if args.only in (None, "recovery"):
        out["recovery"] = recovery(args, base, say)
        ok &= all(r["exit_code"] == 0 for r in out["recovery"]["resild"] + out["recovery"]["torchrun"])
    if args.only in (None, "fallback"):
        out["fallback"] = fallback(args, base, say)
        ok &= all(r["exit_code"] == 0 for r in out["fallback"]["resild"] + out["fallback"]["torchrun"])
    out["loadavg_before"], out["loadavg_after"] = list(load_before), list(os.getloadavg())
    out["workdir"] = str(base)
    if args.json:
        print(json.dumps(out), flush=True)
        return 0 if ok else 1
    if "overhead" in out:
        print_overhead(args, out["overhead"])
    if "recovery" in out:
        print_recovery(args, out["recovery"])
    if "fallback" in out:
        print_fallback(args, out["fallback"])
    fmt = ", ".join(f"{x:.2f}" for x in load_before)
    print(f"\nload average (1, 5, 15 min) before: {fmt}; after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"events, times and logs under {base}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
