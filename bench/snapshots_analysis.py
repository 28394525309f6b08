"""bench/snapshots.py's analysis, pure: event streams and run records in, numbers out
(tests/bench/test_snapshots_bench.py feeds it synthetic events)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import median, select
from bench.torchrun_baseline import analyze as analyze_torchrun
from resild.report.recoveries import NODE_FAILURE, recoveries

#: overhead variants: name -> resild --snapshot-copies (None: plain torchrun)
VARIANTS: dict[str, int | None] = {"plain": None, "k0": 0, "k1": 1, "k2": 2, "k1auto": 1, "k2auto": 2}
DEFAULT_VARIANTS = ("plain", "k0", "k1", "k2")  # the *auto ones: --snapshot-every auto (not run unless asked)
RESILD_COLS = (
    "detect_s",
    "fence_s",
    "reform_s",
    "replay_s",
    "first_step_s",
    "total_s",
    "rolled_back_to",
    "steps_redone",
    "step_s",
    "work_lost_s",
    "caught_up_s",
    "replay_mb",
    "exit_code",
)
TORCHRUN_COLS = (
    "detect_s",
    "restart_s",
    "first_step_s",
    "total_s",
    "resumed_step",
    "steps_redone",
    "step_s",
    "work_lost_s",
    "caught_up_s",
    "ckpt_save_s",
    "exit_code",
)
FALLBACK_RESILD_COLS = (
    "failures",
    "detect_s",
    "fence_s",
    "reform_s",
    "load_s",
    "first_step_s",
    "total_s",
    "ckpt_step",
    "ckpt_load_s",
    "steps_redone",
    "step_s",
    "work_lost_s",
    "caught_up_s",
    "exit_code",
)
_COUNTS = {"failures", "ckpt_step", "resumed_step", "steps_redone"}  # medians shown as integers when whole
#: part 3's side-by-side table (torchrun's ``ckpt_step`` is its ``resumed_step``)
FALLBACK_COLS = ("runs", "total_s", "ckpt_step", "steps_redone", "step_s", "work_lost_s", "caught_up_s")


# ---- analysis (pure: events and run records in, numbers out) --------------------------------
def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _div(a: Any, b: Any) -> float | None:
    return a / b if _num(a) and _num(b) and b > 0 else None


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def _kb(b: float | None) -> float | None:
    return None if b is None else b / 1024.0


def _med_int(xs: Iterable[Any]) -> float | int | None:
    vals = [x for x in xs if _num(x)]
    m = median(vals)
    return int(m) if m is not None and float(m).is_integer() else m


def snapshot_stats(events: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One run's ``snapshots`` events (one per rank, the last of each rank): medians
    over ranks. Empty fields (None) when no rank reported (K = 0, or a failed run)."""
    by_rank: dict[Any, dict[str, Any]] = {}
    for e in select(events, "snapshots"):
        by_rank[e.get("rank")] = e  # sorted by time: a rank's last report wins
    rs = list(by_rank.values())
    per_snap = [_div(e.get("capture_s"), e.get("taken")) for e in rs]
    return {
        "ranks_reporting": len(rs),
        "copies": _med_int(e.get("copies") for e in rs),
        "every": _med_int(e.get("every") for e in rs),
        "taken": _med_int(e.get("taken") for e in rs),
        "skipped": _med_int(e.get("skipped") for e in rs),
        "capture_s": median(e.get("capture_s") for e in rs if _num(e.get("capture_s"))),
        "capture_per_snapshot_s": median(x for x in per_snap if x is not None),
        "exchange_s": median(e.get("exchange_s") for e in rs if _num(e.get("exchange_s"))),
        "held_bytes": _med_int(e.get("held_bytes") for e in rs),
        "held_bytes_max": max((int(e["held_bytes"]) for e in rs if _num(e.get("held_bytes"))), default=None),
    }


def overhead_rows(runs: Sequence[dict[str, Any]], variants: Sequence[str]) -> list[dict[str, Any]]:
    """One row per variant from the runs' records (``variant``, ``step_s``, ``commit_s``,
    ``compute_s``, ``exit_code``, ``state_bytes``, ``snapshots`` = snapshot_stats)."""
    by = {v: [r for r in runs if r.get("variant") == v] for v in variants}
    plain_ms = _ms(median(r.get("step_s") for r in by.get("plain", [])))
    out = []
    for v in variants:
        rs = by[v]
        snaps = [r.get("snapshots") or {} for r in rs]
        row: dict[str, Any] = {
            "variant": v,
            "copies": VARIANTS.get(v),
            "runs": len(rs),
            "step_ms": _ms(median(r.get("step_s") for r in rs)),
            "commit_ms": _ms(median(r.get("commit_s") for r in rs)),
            "compute_ms": _ms(median(r.get("compute_s") for r in rs)),
            "state_kb": _kb(median(r.get("state_bytes") for r in rs)),
            "held_kb": _kb(median(s.get("held_bytes") for s in snaps)),
            "capture_ms": _ms(median(s.get("capture_per_snapshot_s") for s in snaps)),
            "exchange_ms": _ms(median(s.get("exchange_s") for s in snaps)),
            "taken": _med_int(s.get("taken") for s in snaps),
            "skipped": _med_int(s.get("skipped") for s in snaps),
            "failed_runs": sum(1 for r in rs if r.get("exit_code") != 0 or r.get("step_s") is None),
        }
        row["ratio"] = _div(row["step_ms"], plain_ms)
        row["held_x"] = _div(row["held_kb"], row["state_kb"])
        every = median(s.get("every") for s in snaps) or 1
        row["capture_pct"] = (
            None
            if _div(row["capture_ms"], row["step_ms"]) is None
            else 100.0 * row["capture_ms"] / row["step_ms"] / every
        )
        # the same repeat's plain run as the yardstick (they ran next to each other)
        pl = {r.get("repeat"): r.get("step_s") for r in by.get("plain", [])}
        ratios = [_div(r.get("step_s"), pl.get(r.get("repeat"))) for r in rs] if v != "plain" else []
        pairs = [p for p in ratios if p is not None]
        row["pair_ratio_min"], row["pair_ratio_max"] = (min(pairs), max(pairs)) if pairs else (None, None)
        out.append(row)
    return out


def resild_recovery(
    events: Sequence[dict[str, Any]], step_s: float | None, fault_node: str = "local-node1"
) -> dict[str, Any]:
    """The first node failure's recovery (resild.report.recoveries), the rollback and the replay."""
    res: dict[str, Any] = dict.fromkeys(RESILD_COLS)
    res.update(rolled_back_newest=None, replay_bytes=None, replay_sources=None, replay_source=None, outcome=None)
    res["step_s"] = step_s
    rec = next((r for r in recoveries(events) if r.kind == NODE_FAILURE and r.node == fault_node), None)
    if rec is None:
        return res
    ph = rec.phases
    res.update(
        detect_s=ph.get("detection"),
        fence_s=ph.get("fence"),
        reform_s=ph.get("re-form"),
        replay_s=ph.get("replay"),
        first_step_s=ph.get("first step"),
        total_s=rec.recovery_s,
        outcome=rec.outcome,
        steps_redone=rec.steps_redone,
        replay_bytes=rec.bytes_replayed,
        replay_mb=rec.bytes_replayed / 1e6,
    )
    rb = [e for e in select(events, "rolled_back") if e.get("epoch") == rec.epoch]
    if rb:
        res["rolled_back_to"] = rb[0].get("step")
        res["rolled_back_newest"] = rb[0].get("newest")
        if _num(rb[0].get("steps_redone")):
            res["steps_redone"] = int(rb[0]["steps_redone"])
    reps = [e for e in select(events, "state_replayed") if e.get("epoch") == rec.epoch]
    res["replay_sources"] = sorted({s for e in reps for s in (e.get("sources") or [])})
    res["replay_source"] = ",".join(sorted({str(e.get("source")) for e in reps})) or None
    res["replay_transfer_s"] = max((float(e["seconds"]) for e in reps if _num(e.get("seconds"))), default=None)
    if _num(res["steps_redone"]) and _num(step_s):
        res["work_lost_s"] = res["steps_redone"] * step_s
    if _num(res["total_s"]):
        res["caught_up_s"] = res["total_s"] + (res["work_lost_s"] or 0.0)
    return res


def torchrun_recovery(events: Sequence[dict[str, Any]], nproc: int, kill_at: int) -> dict[str, Any]:
    """bench.torchrun_baseline.analyze, plus the work lost (steps redone x step time)."""
    res = analyze_torchrun(list(events), nproc=nproc, kill_at=kill_at)
    res["step_s"] = res.get("step_time_s")
    res["work_lost_s"] = (
        res["steps_redone"] * res["step_s"] if _num(res.get("steps_redone")) and _num(res["step_s"]) else None
    )
    return res


def summarize_recovery(
    resild_runs: Sequence[dict[str, Any]], torchrun_runs: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Medians per side and the ratios torchrun / resild."""
    rs = {k: _med_int(r.get(k) for r in resild_runs) for k in RESILD_COLS if k != "exit_code"}
    tr = {k: _med_int(r.get(k) for r in torchrun_runs) for k in TORCHRUN_COLS if k != "exit_code"}
    return {
        "resild": rs,
        "torchrun": tr,
        "speedup": _div(tr.get("total_s"), rs.get("total_s")),
        "speedup_caught_up": _div(tr.get("caught_up_s"), rs.get("caught_up_s")),
    }


def fallback_recovery(events: Sequence[dict[str, Any]], step_s: float | None) -> dict[str, Any]:
    """The recovery that loaded resild's own disk checkpoint (``recovered_from`` "checkpoint"),
    timed from the first of the failures it brought back to full strength (every node lost
    at once: each is a failure of its own, all ending at the same full-strength step)."""
    res: dict[str, Any] = dict.fromkeys(FALLBACK_RESILD_COLS)
    res.update(step_s=step_s, nodes_lost=None, recovered_from=None, outcome=None, ckpt_why=None, resumed_step=None)
    recs = recoveries(events)
    rec = next((r for r in recs if r.recovered_from == "checkpoint"), None)
    if rec is None:
        lost = [r for r in recs if r.kind == NODE_FAILURE]
        res.update(failures=len(lost), nodes_lost=sorted(str(r.node) for r in lost))
        res["outcome"] = ",".join(sorted({r.outcome for r in lost})) or None
        return res
    group = [
        r for r in recs if r.kind == NODE_FAILURE and r.index <= rec.index and r.t_first_step == rec.t_first_step
    ] or [rec]
    t0 = min(r.t_fault for r in group)
    t_det = max(r.t_detected for r in group)
    bounds = [t0, t_det, rec.t_fenced, rec.t_reformed, rec.t_replayed, rec.t_first_step]
    mono: list[float] = []
    for b in bounds:
        prev = mono[-1] if mono else t0
        mono.append(prev if b is None else max(b, prev))
    names = ("detect_s", "fence_s", "reform_s", "load_s", "first_step_s")
    res.update({k: mono[i + 1] - mono[i] for i, k in enumerate(names)})
    res.update(
        failures=len(group),
        nodes_lost=sorted(str(r.node) for r in group),
        total_s=rec.t_first_step - t0 if rec.t_first_step is not None else None,
        recovered_from=rec.recovered_from,
        outcome=rec.outcome,
        resumed_step=rec.resumed_step,
        steps_redone=rec.steps_redone,
    )
    loads = [e for e in select(events, "checkpoint_loaded") if e.get("epoch") in (None, rec.epoch)]
    if loads:
        res["ckpt_step"] = loads[0].get("step")
        res["ckpt_load_s"] = loads[0].get("seconds")
        res["ckpt_why"] = loads[0].get("why")
    elif rec.resumed_step is not None:
        res["ckpt_step"] = rec.resumed_step
    if res["steps_redone"] is None and _num(res["ckpt_step"]):
        # no committed step at detection: the injected fault's step
        k = next((e.get("step") for e in select(events, "fault_injected") if _num(e.get("step"))), None)
        res["steps_redone"] = None if k is None else max(0, int(k) - int(res["ckpt_step"]))
    if _num(res["steps_redone"]) and _num(step_s):
        res["work_lost_s"] = res["steps_redone"] * step_s
    if _num(res["total_s"]):
        res["caught_up_s"] = res["total_s"] + (res["work_lost_s"] or 0.0)
    return res


def summarize_fallback(
    resild_runs: Sequence[dict[str, Any]], torchrun_runs: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Medians per side, the ratios torchrun / resild, and the side-by-side table's rows."""

    def med(k: str, runs: Sequence[dict[str, Any]]) -> Any:
        xs = [r.get(k) for r in runs if _num(r.get(k))]
        return _med_int(xs) if k in _COUNTS else median(xs)

    rs = {k: med(k, resild_runs) for k in FALLBACK_RESILD_COLS if k != "exit_code"}
    tr = {k: med(k, torchrun_runs) for k in TORCHRUN_COLS if k != "exit_code"}
    speedup = _div(tr.get("total_s"), rs.get("total_s"))
    speedup_caught_up = _div(tr.get("caught_up_s"), rs.get("caught_up_s"))
    cols = [c for c in FALLBACK_COLS if c != "runs"]
    rows = [
        {"side": "resild", "runs": len(resild_runs), **{c: rs.get(c) for c in cols}},
        {
            "side": "torchrun",
            "runs": len(torchrun_runs),
            **{c: tr.get("resumed_step" if c == "ckpt_step" else c) for c in cols},
        },
        {"side": "torchrun/resild", "total_s": speedup, "caught_up_s": speedup_caught_up},
    ]
    return {
        "resild": rs,
        "torchrun": tr,
        "speedup": speedup,
        "speedup_caught_up": speedup_caught_up,
        "rows": rows,
    }
