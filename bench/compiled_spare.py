"""Is a compiled model's spare ready before it is needed? (issue 36: compiled models.)

Three paths, side by side in one invocation, rotating their order round by round so that
none always runs on a warmer machine, all ``resil-run --local --nodes 3 --spares 1`` of
``examples/train_fsdp.py`` (plain FSDP2):

- ``eager``: the example as it is (nothing compiled): the yardstick.
- ``prepared``: ``--compile``: each Linear under torch.compile; the script hands
  ``launcher.init(prepare=...)`` a function that builds, compiles and runs the model, and
  the waiting spare runs it before any fault (its real model then compiles nothing).
- ``unprepared``: ``--compile`` with ``RESILD_SPARE_PREPARE=0``: the spare compiles after
  it took over, as before.

Every node gets an inductor cache directory of its own, empty at the start of each run
(``TORCHINDUCTOR_CACHE_DIR``), as separate hosts of a fresh allocation have: on one machine
the nodes would otherwise share the compiled kernels, and an unprepared spare would find
its compilation done by the others. Once the job trains at full strength and the spare
has warmed up (``spare_warmed``: its preparation included), the node process of
``local-node0`` and its worker are SIGKILLed; the bench waits for the first step
committed at full strength in the new epoch, then stops the job (SIGINT).

Measured: ``recovery_s`` (the kill → that step), ``graphs`` (what the spare compiled in
its first step after taking over: ``spare_compiled``), ``warm_s`` (the spare's warm-up,
its preparation included, spent while it waited). ``ratio`` = median recovery_s of a path
/ that of ``eager``; the issue's target: ``prepared`` within 2x of ``eager``. Nothing here
asserts on timings: it prints what it measured.

    python bench/compiled_spare.py [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path: the repository root on sys.path for `bench`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import REPO, resil_run
from bench.join_spare import VICTIM, _events, _wait, running

PATHS = ("eager", "prepared", "unprepared")
SCRIPT = REPO / "examples" / "train_fsdp.py"
TARGET_RATIO = 2.0


def worker(path: str, caches: Path) -> list[str]:
    """The worker command: the example, with an inductor cache of its node's own."""
    script = [sys.executable, str(SCRIPT), "--steps", "1000000", *(["--compile"] if path != "eager" else [])]
    return ["sh", "-c", 'export TORCHINDUCTOR_CACHE_DIR="$0/$RESILD_NODE"; exec "$@"', str(caches), *script]


def one_run(path: str, tmp: Path) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    events = tmp / "events.jsonl"
    cmd = resil_run(
        "--run-dir",
        str(tmp / "run"),
        "--events",
        str(events),
        "--quiet",
        "--hang-timeout",
        "120",  # a compiled job's first step compiles for seconds: no hang
        nodes=3,
        spares=1,
        nproc_per_node=1,
        worker=worker(path, tmp / "inductor"),
    )
    if path == "unprepared":
        os.environ["RESILD_SPARE_PREPARE"] = "0"  # read by `running`'s environment copy
    try:
        with running(path, cmd, tmp) as r:
            job = r.job
            _wait(events, lambda e: e["event"] == "full_strength_step", "the first step", job)
            warmed = _wait(events, lambda e: e["event"] == "spare_warmed", "the spare's warm-up", job)
            pid = [e["pid"] for e in _events(events) if e["event"] == "node_registered" and e["node"] == VICTIM][-1]
            t_kill = time.monotonic()
            os.killpg(pid, signal.SIGKILL)
            full = _wait(
                events, lambda e: e["event"] == "full_strength_step" and e.get("epoch", 1) > 1, "full strength", job
            )
            compiled = _wait(events, lambda e: e["event"] == "spare_compiled", "the spare's first-step report", job)
    finally:
        os.environ.pop("RESILD_SPARE_PREPARE", None)
    return {
        "path": path,
        "recovery_s": round(full["t_mono"] - t_kill, 4),
        "graphs": compiled.get("graphs"),
        "warm_s": warmed.get("seconds"),
        "warm_error": warmed.get("error") or warmed.get("prepare_error"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per path and the ratios to `eager`. Pure."""

    def med(path: str, key: str) -> float | None:
        xs = [float(r[key]) for r in runs if r["path"] == path and r.get(key) is not None]
        return round(statistics.median(xs), 4) if xs else None

    out: dict[str, Any] = {}
    base = med("eager", "recovery_s")
    for p in PATHS:
        rec = med(p, "recovery_s")
        out[f"{p}_recovery_s"] = rec
        out[f"{p}_graphs"] = med(p, "graphs")
        out[f"{p}_ratio"] = round(rec / base, 3) if rec is not None and base else None
    ratio = out["prepared_ratio"]
    out["target"] = f"prepared within {TARGET_RATIO:g}x of eager"
    out["target_met"] = None if ratio is None else ratio <= TARGET_RATIO
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="rounds (each runs every path once)")
    p.add_argument("--json", action="store_true", help="one JSON object: every run and the summary")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error("--runs must be at least 1")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="resild-bench-") as d:
        for i in range(a.runs):
            order = PATHS[i % 3 :] + PATHS[: i % 3]
            for path in order:
                r = one_run(path, Path(d) / f"{i}-{path}")
                runs.append(r)
                if not a.json:
                    print(
                        f"run {i + 1}/{a.runs} {path:10} " + " ".join(f"{k}={v}" for k, v in r.items() if k != "path")
                    )
    summary = summarize(runs)
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}))
    else:
        print(" ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
