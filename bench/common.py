"""Small helpers shared by the recovery benchmarks (baseline torchrun side and resild side).

Event files are JSON lines, one event per line, each with at least ``event``, ``rank``,
``t_wall`` (time.time(), comparable across processes on one machine) and
``restart_count``. Phases are reported in seconds.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: Recovery phases, in order; they add up: detect + restart + first_step == total.
PHASES = ("detect_s", "restart_s", "first_step_s", "total_s")


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All well-formed events in ``path``, sorted by ``t_wall``.

    A torn last line (a writer killed mid-write) or any other line that is not a JSON
    object is skipped, not fatal. A missing file reads as no events.
    """
    out: list[dict[str, Any]] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "event" in rec:
            out.append(rec)
    out.sort(key=lambda e: e.get("t_wall", 0.0))
    return out


def select(events: Iterable[dict[str, Any]], event: str | None = None, **match: Any) -> list[dict[str, Any]]:
    """Events with the given ``event`` name whose fields equal ``match``."""
    return [
        e for e in events if (event is None or e.get("event") == event) and all(e.get(k) == v for k, v in match.items())
    ]


def median(xs: Iterable[float | None]) -> float | None:
    """Median of the values that are not None, or None when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def step_intervals(
    events: Iterable[dict[str, Any]], rank: int, restart_count: int, first: int | None = None, last: int | None = None
) -> list[float]:
    """Seconds between consecutive ``step`` events of one rank in one attempt.

    Only pairs (k-1, k) with ``first < k <= last`` (bounds optional) are counted, so
    the caller can leave out the steps next to a fault or a restart.
    """
    steps = {e["step"]: e["t_wall"] for e in select(events, "step", rank=rank, restart_count=restart_count)}
    out: list[float] = []
    for k in sorted(steps):
        if k - 1 not in steps:
            continue
        if first is not None and k <= first:
            continue
        if last is not None and k > last:
            continue
        out.append(steps[k] - steps[k - 1])
    return out


def _fmt(v: object, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def phase_table(
    rows: Sequence[dict[str, Any]], columns: Sequence[str] = PHASES, label: str = "run", digits: int = 3
) -> str:
    """A plain-text table, one row per result dict, plus a median row when there are several.

    Floats are shown with ``digits`` decimals."""
    header = [label, *columns]
    body = [[str(r.get(label, i + 1)), *(_fmt(r.get(c), digits) for c in columns)] for i, r in enumerate(rows)]
    if len(rows) > 1:
        meds = []
        for c in columns:
            vals = [r.get(c) for r in rows if isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)]
            m = median(vals)
            if m is not None and all(isinstance(v, int) for v in vals) and float(m).is_integer():
                m = int(m)
            meds.append(_fmt(m, digits))
        body.append(["median", *meds])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def print_phase_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] = PHASES, label: str = "run") -> None:
    print(phase_table(rows, columns, label))
