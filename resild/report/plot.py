"""Pictures of a goodput breakdown: a PNG (matplotlib, Agg: no display needed) or an HTML page.

Kept apart from `resild.report.goodput` so the analysis imports nothing heavy; matplotlib is
imported only when a picture is asked for.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from resild.report.goodput import Breakdown, format_breakdown
from resild.report.recoveries import PHASES

PHASE_COLORS = {
    "detection": "#d62728",
    "fence": "#ff7f0e",
    "re-form": "#bcbd22",
    "replay": "#1f77b4",
    "first step": "#9467bd",
}
PART_COLORS = {
    "productive steps": "#2ca02c",
    "start-up": "#7f7f7f",
    "recovery": "#d62728",
    "redone steps": "#ff7f0e",
    "idle / slow steps": "#c7c7c7",
    "shutdown": "#aec7e8",
}
MAX_GANTT_ROWS = 12


def render_png(b: Breakdown, title: str = "") -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # not pyplot: no global state, no display

    fig = Figure(figsize=(12, 7.2), dpi=110)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(
        2,
        2,
        height_ratios=[3, 1.5],
        width_ratios=[1.6, 1],
        hspace=0.5,
        wspace=0.25,
        bottom=0.2,
        top=0.9,
        left=0.08,
        right=0.93,
    )
    _timeline(fig.add_subplot(gs[0, :]), b)
    _gantt(fig.add_subplot(gs[1, 0]), b)
    _parts(fig.add_subplot(gs[1, 1]), b)
    gp = "-" if b.goodput is None else f"{b.goodput * 100:.1f}%"
    tg = "-" if b.training_goodput is None else f"{b.training_goodput * 100:.1f}%"
    n = len([f for f in b.failures if f.kind != "spare lost"])
    fig.suptitle(
        f"{title + ': ' if title else ''}job {b.outcome}, {b.steps} steps, {n} failure(s) — goodput {gp} "
        f"of wall time, {tg} of the training window",
        fontsize=12,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _timeline(ax: Any, b: Breakdown) -> None:
    ax.set_title("committed step against wall time; faults, recovery phases and spares left", fontsize=10)
    if b.startup_s > 0:
        ax.axvspan(0, b.startup_s, color=PART_COLORS["start-up"], alpha=0.15, lw=0)
        ax.text(
            b.startup_s / 2,
            0.97,
            "start-up",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
            color="#555555",
        )
    if b.step_line:
        ts, steps = zip(*b.step_line)
        ax.plot(ts, steps, color=PART_COLORS["productive steps"], lw=1.8, label="committed step")
    for f in b.failures:
        x = f.t_fault
        ax.axvline(x, color="#d62728", lw=1, ls="--")
        label = f"#{f.index} {f.fault or f.kind}"
        if f.recovery_s is not None:
            label += f"\n{f.recovery_s * 1000:.0f} ms to full strength"
        ax.annotate(
            label,
            (x, 0.5),
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=7.5,
            color="#d62728",
            rotation=90,
            va="center",
        )
        t = x
        for p in PHASES:  # sub-second on a minutes-long line: drawn, and readable in the panel below
            d = f.phases.get(p, 0.0)
            if d > 0:
                ax.axvspan(t, t + d, color=PHASE_COLORS[p], alpha=0.5, lw=0)
            t += d
    ax.set_xlabel("seconds since job start")
    ax.set_ylabel("committed step")
    ax.set_xlim(left=0, right=max(b.wall_s, 1e-3) * 1.01)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    if b.spares_line:
        ts, sp = zip(*(b.spares_line + [(b.wall_s, b.spares_line[-1][1])]))
        ax2.step(ts, sp, where="post", color="#17becf", lw=1.5, ls="-.", label="hot spares left")
    if b.queued_line:
        ts, q = zip(*([(0.0, 0)] + b.queued_line + [(b.wall_s, b.queued_line[-1][1])]))
        ax2.step(ts, q, where="post", color="#bcbd22", lw=1.2, ls=":", label="cold spares queued")
    ax2.set_ylabel("hot spares left", color="#17becf")
    top = max([1, b.initial_spares] + [n for _, n in b.spares_line + b.queued_line])
    ax2.set_ylim(-0.2, top + 0.5)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)


def _gantt(ax: Any, b: Breakdown) -> None:
    rows = [f for f in b.failures if f.phases][:MAX_GANTT_ROWS]
    ax.set_title("each recovery, phase by phase (ms from the fault)", fontsize=10)
    if not rows:
        ax.text(0.5, 0.5, "no failures", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    for i, f in enumerate(rows):
        t = 0.0
        for p in PHASES:
            d = f.phases.get(p, 0.0) * 1000
            ax.barh(i, d, left=t, color=PHASE_COLORS[p], label=p if i == 0 else None, height=0.6)
            t += d
        end = "" if f.recovery_s is not None else " (not recovered)"
        ax.text(t, i, f" {t:.0f} ms{end}", va="center", fontsize=7.5)
    ax.set_yticks(range(len(rows)), [f"#{f.index} {f.node or ''}" for f in rows], fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(right=ax.get_xlim()[1] * 1.25)
    ax.legend(fontsize=7, ncol=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.12), frameon=False)
    if len(b.failures) > len(rows):
        ax.text(
            1, -0.3, f"first {len(rows)} of {len(b.failures)} failures", transform=ax.transAxes, ha="right", fontsize=7
        )


def _parts(ax: Any, b: Breakdown) -> None:
    ax.set_title("where the wall time went", fontsize=10)
    left = 0.0
    wall = b.wall_s or 1.0
    for name, v in b.parts():
        share = v / wall * 100
        ax.barh(0, share, left=left, color=PART_COLORS[name], label=f"{name} {share:.1f}%", height=0.5)
        left += share
    ax.set_xlim(0, 100)
    ax.set_yticks([])
    ax.set_xlabel("% of wall time")
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.5), ncol=2, frameon=False)


def render_html(b: Breakdown, title: str = "") -> str:
    png = base64.b64encode(render_png(b, title)).decode("ascii")
    name = html.escape(title or "resild job report")
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{name}</title>\n'
        "<style>body{font-family:sans-serif;margin:2em}pre{font-size:12px;background:#f6f6f6;padding:1em}"
        "</style></head><body>\n"
        f'<h1>{name}</h1>\n<img alt="timeline" style="max-width:100%" src="data:image/png;base64,{png}">\n'
        f"<h2>Where the time went</h2>\n<pre>{html.escape(format_breakdown(b))}</pre>\n"
        "<details><summary>JSON</summary><pre>"
        f"{html.escape(json.dumps(b.to_dict(), indent=1))}</pre></details>\n</body></html>\n"
    )


def write_plot(b: Breakdown, path: Path, title: str = "") -> None:
    """PNG, or an HTML page (the PNG embedded, the table, the JSON) when the name ends in .html/.htm."""
    if path.suffix.lower() in (".html", ".htm"):
        path.write_text(render_html(b, title), encoding="utf-8")
    else:
        path.write_bytes(render_png(b, title))
