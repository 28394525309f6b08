"""The end-of-run summary, computed from the event stream alone."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FailureSummary:
    node: str
    cause: str
    detector: str
    fault: str | None
    detect_s: float | None
    recovery_s: float | None
    steps_lost: int | None
    bytes_replayed: int
    replay_s: float | None


def summarize(events: list[dict[str, Any]]) -> tuple[list[FailureSummary], dict[str, Any]]:
    out: list[FailureSummary] = []
    last_fault: dict[str, dict] = {}
    for i, e in enumerate(events):
        if e["event"] == "fault_injected":
            last_fault[e["node"]] = e
        if e["event"] != "failure_detected":
            continue
        fault = last_fault.pop(e["node"], None)
        t0 = fault["t_mono"] if fault else e["t_mono"]
        later = events[i + 1:]
        assigned = next((x for x in later if x["event"] == "spare_assigned" and x["failed"] == e["node"]), None)
        full = resumed = None
        replayed: list[dict] = []
        if assigned is not None:
            ep = assigned["epoch"]
            full = next((x for x in later if x["event"] == "full_strength_step" and x["epoch"] >= ep), None)
            resumed = next((x for x in later if x["event"] == "resumed" and x.get("epoch", 0) >= ep), None)
            replayed = [x for x in later if x["event"] == "state_replayed" and x.get("epoch") == ep]
        out.append(FailureSummary(
            node=e["node"], cause=e["cause"], detector=e.get("detector", ""),
            fault=fault["spec"] if fault else None,
            detect_s=(e["t_mono"] - fault["t_mono"]) if fault else None,
            recovery_s=(full["t_mono"] - t0) if full else None,
            # Negative would mean the survivors committed more steps before the notice (a GPU
            # fault leaves processes running): nothing lost either way.
            steps_lost=max(0, e["committed_step"] - resumed["step"]) if resumed else None,
            bytes_replayed=sum(int(x["bytes"]) for x in replayed),
            replay_s=max((float(x["seconds"]) for x in replayed), default=None)))
    job: dict[str, Any] = {}
    fin = next((e for e in events if e["event"] == "job_finished"), None)
    if fin is not None and fin.get("step_s"):
        step_s = fin["step_s"]
        train_s = fin["train_s"]
        job = {"steps": fin["step"], "step_s": step_s, "train_s": train_s,
               "goodput": min(1.0, fin["step"] * step_s / train_s) if train_s > 0 else None}
    return out, job


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f}{unit}"


def format_table(failures: list[FailureSummary], job: dict[str, Any]) -> str:
    lines = []
    if failures:
        lines.append(f"{'#':>2} {'node':<13} {'fault':<22} {'detector':<13} {'detect':>8} {'recovery':>9} "
                     f"{'lost':>4} {'replayed':>10}  cause")
        for i, f in enumerate(failures, 1):
            mb = f"{f.bytes_replayed / 1e6:.1f}MB" if f.bytes_replayed else "-"
            lines.append(f"{i:>2} {f.node:<13} {(f.fault or '-'):<22} {f.detector:<13} {_fmt(f.detect_s):>8} "
                         f"{_fmt(f.recovery_s):>9} {('-' if f.steps_lost is None else f.steps_lost):>4} {mb:>10}  {f.cause}")
    else:
        lines.append("no failures")
    if job:
        gp = job.get("goodput")
        lines.append(f"steps {job['steps']}, median step {job['step_s'] * 1000:.1f}ms, training wall {job['train_s']:.2f}s, "
                     f"goodput {'-' if gp is None else f'{gp * 100:.1f}%'}")
    return "\n".join(lines)
