"""The end-of-run summary, computed from the event stream alone."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TextIO

from resild.events.schema import RECOVERY_EVENTS, EventName, JobFinished, event_time
from resild.procutil import say
from resild.report.checkpoints import CheckpointCounts, checkpoint_counts
from resild.report.goodput import (
    FailureBreakdown,
    failure_breakdowns,
    step_time,
    stragglers,
    unvouched,
    unvouched_line,
)
from resild.report.recoveries import Recovery, recoveries


def summarize(events: list[dict[str, Any]]) -> tuple[list[FailureBreakdown], dict[str, Any]]:
    # The recoveries are `resild report`'s (resild.report.goodput, from resild.report.recoveries):
    # the two agree. Steps lost (redone) are clamped at 0: a GPU fault leaves processes running,
    # so the survivors may commit more steps before the notice.
    out = failure_breakdowns(events)
    job: dict[str, Any] = {}
    fin_rec = next((e for e in events if e.get("event") == EventName.JOB_FINISHED), None)
    fin = JobFinished.from_record(fin_rec) if fin_rec is not None else None
    # The controller's median sees only the slow steps when commits are reported per node every
    # 100 ms; progress events give a second estimate (resild.report.goodput.step_time takes the smaller).
    step_s = step_time(events, fin_rec) if fin is not None else None
    if fin is not None and step_s and fin.step is not None and fin.train_s is not None:
        train_s = fin.train_s
        job = {
            "steps": fin.step,
            "step_s": step_s,
            "train_s": train_s,
            "goodput": min(1.0, fin.step * step_s / train_s) if train_s > 0 else None,
        }
    ck = checkpoint_counts(events)
    if ck is not None:
        job["checkpoints"] = ck.to_dict()
    why = unvouched(events)
    if why is not None:
        job["unvouched"] = why
    slow = stragglers(events)
    if slow:
        job["stragglers"] = slow
    return out, job


def _fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.3f}{unit}"


def format_table(failures: list[FailureBreakdown], job: dict[str, Any]) -> str:
    lines = []
    if failures:
        lines.append(
            f"{'#':>2} {'node':<13} {'fault':<22} {'detector':<13} {'detect':>8} {'recovery':>9} "
            f"{'redone':>6} {'from':<8} {'replayed':>10}  cause"
        )
        for i, f in enumerate(failures, 1):
            mb = f"{f.bytes_replayed / 1e6:.1f}MB" if f.bytes_replayed else "-"
            lines.append(
                f"{i:>2} {(f.node or '-'):<13} {(f.fault or '-'):<22} {f.detector:<13} {_fmt(f.detect_s):>8} "
                f"{_fmt(f.recovery_s):>9} {('-' if f.steps_lost is None else f.steps_lost):>6} "
                f"{(f.recovered_from or '-'):<8} {mb:>10}  {f.cause}"
            )
    else:
        lines.append("no failures")
    if job.get("checkpoints"):
        lines.append(CheckpointCounts(**job["checkpoints"]).line())
    if job.get("steps") is not None:
        gp = job.get("goodput")
        lines.append(
            f"steps {job['steps']}, median step {job['step_s'] * 1000:.1f}ms, training wall {job['train_s']:.2f}s, "
            f"goodput {'-' if gp is None else f'{gp * 100:.1f}%'}"
        )
    if job.get("unvouched"):  # last: the line a person must not miss
        lines.append(unvouched_line(job["unvouched"]))
    return "\n".join(lines)


# ---- live status: one line while the job runs, driven by the event stream -----------------------
def print_summary(
    code: int, reason: str, events: list[dict[str, Any]], as_json: bool, extra: dict[str, Any] | None = None
) -> None:
    """resil-run's last words, whichever controller ran the job: the JSON summary on stdout
    (--json; `extra` adds fields), else the failure table on stderr; then the reason of a failure."""
    failures, job = summarize(events)
    if as_json:
        body = {"exit_code": code, "reason": reason, "job": job, **(extra or {})}
        body["failures"] = [f.summary() for f in failures]
        print(json.dumps(body, indent=2))
    else:
        say(format_table(failures, job))
    if code != 0:
        say(f"resil-run: job failed: {reason}")


class StatusLine:
    """An EventLog listener that keeps a person watching a long job informed.

    It prints at once on what matters (training started, a failure, back at full strength,
    spares used up) and otherwise at most every `every_s` while steps advance. On a terminal
    the periodic line is rewritten in place; in a log file (Slurm output) each is its own
    line. It writes only to `out` (stderr): stdout stays clean for --json.
    """

    def __init__(
        self, out: TextIO, every_s: float = 5.0, tty: bool | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.out = out
        self.every_s = every_s
        self.tty = out.isatty() if tty is None else tty
        self.clock = clock
        self.t0: float | None = None
        self.step = 0
        self.epoch = 0
        self.rate: float | None = None
        self.spares: int | None = None
        self.spares0: int | None = None
        self.queued = 0  # cold spares asked of the queue (--spare-target), not joined yet
        self.ranks: tuple[int, int] | None = None  # (width, full width) while the job is shrunk
        self.nodes: list[str] = []
        self.last_failure: str | None = None
        self.recovering_since: float | None = None
        self.awaiting_epoch: int | None = None
        self.layout: set[str] = set()
        self.workers = 0
        self.leader: int | None = None  # the leading controller replica (--controllers N)
        # What the recoveries analysis reads (not progress): the recovery times shown are
        # resild.report.recoveries', as in the end-of-run table and `resild report`.
        self._recovery_events: list[dict[str, Any]] = []
        self._prev: tuple[float, int, int] | None = None  # (t, step, epoch) of the last progress point
        self._last_print = float("-inf")
        self._partial = False  # a rewritable line is on screen

    # -- the listener ---------------------------------------------------------------
    def __call__(self, e: dict[str, Any]) -> None:
        name = e.get("event")
        t = float(e.get("t_log", e.get("t_mono", self.clock())))
        if name in RECOVERY_EVENTS:
            self._recovery_events.append(e)
        if name == EventName.JOB_STARTED:
            self.t0, self.nodes = t, list(e.get("nodes") or [])
        elif name == EventName.WORKER_REGISTERED and self.epoch == 0:
            self.workers += 1  # start-up can take minutes at scale: show it moving
            if self.clock() - self._last_print >= self.every_s:
                self._line(
                    f"starting: {self.workers} workers ready on {len(self.nodes)} nodes", t, permanent=not self.tty
                )
        elif name == EventName.MEMBERSHIP:
            layout = e.get("layout") or {}
            self.layout = set(layout)
            first = self.epoch == 0
            self.epoch = int(e.get("epoch", self.epoch))
            if first:
                self.spares = self.spares0 = max(0, len(self.nodes) - len(layout))
                self._line(
                    f"training started: {len(layout)} nodes, {sum(len(r) for r in layout.values())} ranks, "
                    f"{self.spares} hot spares",
                    t,
                    permanent=True,
                )
        elif name == EventName.PROGRESS:
            step, epoch = int(e["step"]), int(e.get("epoch", self.epoch))
            if self._prev is not None and epoch == self._prev[2] and t > self._prev[0] and step > self._prev[1]:
                self.rate = (step - self._prev[1]) / (t - self._prev[0])
            self._prev = (t, step, epoch)
            self.step, self.epoch = step, epoch
            if self.clock() - self._last_print >= self.every_s:
                self._line(self.status(), t, permanent=not self.tty)
        elif name == EventName.FAILURE_DETECTED:
            node = e.get("node")
            if node not in self.layout:  # a hot spare failed: training goes on
                self.spares = max(0, (self.spares or 0) - 1)
                self._line(f"hot spare {node} lost: {e.get('cause')}; {self.spares} spare(s) left", t, permanent=True)
                return
            self.step = int(e.get("committed_step", self.step))
            self.last_failure = f"{node} ({e.get('detector')})"
            rec = self._latest_recovery()  # from the fault, when its start is known
            self.recovering_since = rec.t_fault if rec is not None else t
            self._line(f"failure: {e.get('cause')} [{e.get('detector')}] at step {self.step}", t, permanent=True)
        elif name == EventName.SPARE_ASSIGNED:
            self.spares = int(e.get("spares_left", self.spares or 0))
            self.awaiting_epoch = int(e["epoch"])
            self._line(
                f"{e.get('spare')} takes over {e.get('failed')}'s ranks (epoch {e['epoch']}), "
                f"{self.spares} spare(s) left",
                t,
                permanent=True,
            )
        elif name == EventName.SPARES_REQUESTED:
            self.queued += int(e.get("count", 0))
        elif name == EventName.STRAGGLER:  # replaced: the failure line follows; reported: this is all
            self._line(f"straggler: {e.get('reason')}", t, permanent=True)
        elif name == EventName.STRAGGLERS_UNWATCHED:
            self._line(f"warning: {e.get('reason')}", t, permanent=True)
        elif name == EventName.JOB_RESIZED:
            self.spares = int(e.get("spares_left", self.spares or 0))
            w, full = int(e.get("world_size", 0)), int(e.get("full", 0))
            self.ranks = (w, full) if 0 < w < full else None
            if e.get("how") == "shrink":
                self.awaiting_epoch = int(e["epoch"])
                what = f"no spare left: the job shrinks to {e.get('world_size')} ranks (epoch {e['epoch']})"
            else:
                what = f"{e.get('node')} joins: the job grows to {e.get('world_size')} ranks (epoch {e['epoch']})"
            self._line(what, t, permanent=True)
        elif name in (EventName.NODE_ADMITTED, EventName.NODE_READMITTED):
            self.spares = int(e.get("spares", (self.spares or 0) + 1))
            if str(e.get("source", "")).startswith("slurm:"):  # a cold spare from the queue arrived
                self.queued = max(0, self.queued - 1)
            how = "joined" if name == EventName.NODE_ADMITTED else "is back"
            self._line(f"{e.get('node')} {how} as a hot spare, {self.spares} spare(s) now", t, permanent=True)
        elif name == EventName.REFORM:
            self.awaiting_epoch = int(e["epoch"])
            rec = self._latest_recovery()
            self.last_failure = "re-form"
            self.recovering_since = rec.t_fault if rec is not None else t
        elif (
            name == EventName.FULL_STRENGTH_STEP
            and self.awaiting_epoch is not None
            and int(e.get("epoch", 0)) >= self.awaiting_epoch
        ):
            rec = self._latest_recovery()
            took = rec.recovery_s if rec is not None and rec.t_first_step == event_time(e) else None
            self.last_failure = (
                f"{self.last_failure or 're-form'} recovered in {took:.2f}s" if took is not None else self.last_failure
            )
            self.awaiting_epoch = self.recovering_since = None
            self.step = int(e.get("step", self.step))
            self._line(
                f"back at full strength at step {self.step}" + (f", {took:.2f}s after the fault" if took else ""),
                t,
                permanent=True,
            )
        elif name == EventName.CONTROLLER_LEADER:
            where = f"pid {e.get('pid')} on {e.get('host')}, term {e.get('term')}"
            if self.leader is None:
                self._line(f"controller replica {e.get('index')} leads ({where})", t, permanent=True)
            else:
                self._line(
                    f"controller replica {self.leader} lost; replica {e.get('index')} leads now ({where}, "
                    f"{e.get('restored')} journal records restored)",
                    t,
                    permanent=True,
                )
            self.leader = e.get("index")
        elif name == EventName.JOB_FAILED:
            self._line(f"job failed: {e.get('reason')}", t, permanent=True)

    def _latest_recovery(self) -> Recovery | None:
        recs = [r for r in recoveries(self._recovery_events) if r.stopped_training]
        return recs[-1] if recs else None

    def status(self) -> str:
        rate = "-" if self.rate is None else f"{self.rate:.1f}"
        spares = "-" if self.spares is None else f"{self.spares}/{self.spares0}"
        s = f"step {self.step} ({rate} steps/s), epoch {self.epoch}, spares {spares}"
        if self.queued:
            s += f" (+{self.queued} queued)"
        if self.ranks is not None:
            s += f", shrunk to {self.ranks[0]}/{self.ranks[1]} ranks"
        if self.recovering_since is not None:
            s += f", recovering from {self.last_failure}"
        elif self.last_failure:
            s += f", last failure: {self.last_failure}"
        return s

    def _line(self, text: str, t: float, permanent: bool) -> None:
        elapsed = "" if self.t0 is None else f"[{t - self.t0:7.1f}s] "
        line = f"resil-run: {elapsed}{text}"
        if self.tty:
            self.out.write("\r\x1b[K" + line + ("\n" if permanent else ""))
            self._partial = not permanent
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self._last_print = self.clock()

    def close(self) -> None:
        """End a rewritable line so that what follows starts on its own line."""
        if self._partial:
            self.out.write("\n")
            self.out.flush()
            self._partial = False
