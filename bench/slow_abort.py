"""A slow abort of the failed epoch's communicator, off the recovery's critical path (issue 38).

NCCL's ``abort()`` takes about a second (measured on an H200), more than the rest of a CPU
recovery. The recovery aborts the old backends in a thread of their own while the new ones
form (launcher/worker/old_backends.py). This bench injects that delay on gloo
(``RESILD_ABORT_DELAY_S``: every old backend's abort takes that much longer) and runs the
same job and fault as ``bench/recovery.py`` (SIGKILL of one worker, a warm spare takes
over) once per delay, the delays' order rotated round by round, side by side:

- ``recover_s``: rank 0's re-form + agree + replay (``resumed.seconds``);
- ``total_s``: fault → the first step committed at full strength;
- ``abort_wait_s``: what the new group waited for the old one's abort (the fence, taken
  only where a late writer exists: an NCCL communicator; 0 on gloo; with ``--fenced``
  gloo's are fenced too, as a GPU recovery is: it waits max(abort, forming), not their sum);
- ``ratio_total``: total_s / total_s at delay 0, per round, then the median.

Before this change the abort ran on the recovering thread: ``total_s`` grew by the delay.
Nothing asserts on timings.

    python bench/slow_abort.py [--delays 0,1,3] [--runs 2] [--fenced] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import read_events, select  # noqa: E402
from bench.recovery import run_resild  # noqa: E402

FIELDS = ("recover_s", "reform_s", "total_s", "abort_wait_s")


def one(
    delay_s: float, workdir: Path, nproc: int, ppn: int, steps: int, kill_at: int, fenced: bool = False
) -> dict[str, Any]:
    spec = f"{delay_s}:fenced" if fenced else str(delay_s)
    res = run_resild(nproc, ppn, steps, kill_at, workdir, env={"RESILD_ABORT_DELAY_S": spec})
    formed = select(read_events(workdir / "events.jsonl"), "group_reformed")
    waits = [float(e.get("abort_wait_s", 0.0)) for e in formed if int(e.get("epoch", 0)) > 1]
    out = {k: res.get(k) for k in FIELDS if k != "abort_wait_s"}
    out.update(delay_s=delay_s, exit_code=res.get("exit_code"), abort_wait_s=max(waits, default=None))
    return out


def summarize(rounds: list[dict[float, dict[str, Any]]]) -> dict[str, Any]:
    """Per delay: the median of each field and of total_s / total_s at delay 0 in the same round."""
    out: dict[str, Any] = {}
    for d in rounds[0]:
        row: dict[str, Any] = {}
        for k in FIELDS:
            xs = [r[d][k] for r in rounds if r[d].get(k) is not None]
            row[k] = statistics.median(xs) if xs else None
        ratios = [
            r[d]["total_s"] / r[0.0]["total_s"]
            for r in rounds
            if 0.0 in r and r[d].get("total_s") and r[0.0].get("total_s")
        ]
        row["ratio_total"] = statistics.median(ratios) if ratios else None
        out[str(d)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--delays", default="0,1,3", help="seconds added to every abort, comma-separated (0 is the baseline)"
    )
    p.add_argument("--runs", type=int, default=2, help="rounds: every delay once per round, the order rotated")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-at", type=int, default=60)
    p.add_argument(
        "--fenced",
        action="store_true",
        help="fence gloo's aborts as NCCL's are (RESILD_ABORT_DELAY_S=S:fenced): what a GPU recovery waits for",
    )
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        delays = sorted({float(x) for x in a.delays.split(",")} | {0.0})
    except ValueError:
        p.error(f"--delays {a.delays!r}: seconds, comma-separated")
    rounds: list[dict[float, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="resild-slow-abort-") as tmp:
        for i in range(a.runs):
            order = delays[i % len(delays) :] + delays[: i % len(delays)]
            got: dict[float, dict[str, Any]] = {}
            for d in order:
                got[d] = one(d, Path(tmp) / f"r{i}-d{d}", a.nproc, a.nproc_per_node, a.steps, a.kill_at, a.fenced)
                if not a.json:
                    print(f"round {i} delay {d:g}s: " + ", ".join(f"{k}={got[d].get(k)}" for k in FIELDS), flush=True)
            rounds.append(got)
    summary = summarize(rounds)
    if a.json:
        print(json.dumps({"runs": [{str(d): r[d] for d in r} for r in rounds], "summary": summary}, indent=2))
    else:
        for delay, row in summary.items():
            print(
                f"delay {delay}s: " + ", ".join(f"{k}={v:.3f}" if v is not None else f"{k}=-" for k, v in row.items())
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
