"""What resild's silent-corruption checks cost (issue 40): the last agreed state kept for a
rollback ("within noise at M >= 10"), and steps computed twice (the cost per verified step).

Six variants of the same job, side by side in one invocation, their order rotated round by
round so that none always runs on a warmer machine; every one ``resil-run --local --nodes 3
--spares 0`` of ``examples/train.py`` (data parallel, 3 replicas):

- ``off``: no checks: the yardstick.
- ``m10-nocopy``: ``--fingerprint-every 10`` with ``RESILD_DIVERGENCE_ROLLBACK=0``: the
  compares alone.
- ``m10``: ``--fingerprint-every 10``: the compares and the copy.
- ``m1``: ``--fingerprint-every 1``: a compare and a copy at every step (the worst case).
- ``v10``, ``v1``: ``--verify-every 10`` and ``1``: one step in 10, or every step, computed
  twice and compared.

Measured, per run: ``step_ms`` (the job's median step, resil-run's summary: a verified
step's two passes count as one step); from each rank's ``agreed_state`` event (written
before DONE; median over ranks): ``capture_ms`` (the training thread's time per copy),
``held_kb`` (host bytes of the copy: one buffer, written again at every agreeing compare);
from ``steps_verified``: ``verified`` (steps computed twice alike). ``ratio`` = median
step_ms of a variant / that of ``off``; ``copy_ratio`` = ``m10`` / ``m10-nocopy`` (the
copy's own cost); ``per_verified_step`` = (step_ms(v1) / step_ms(off)) - 1, the extra
cost of one verified step as a share of a step (v10's is a tenth of it per step, when
the median step is not a verified one: see its ``ratio``). Nothing asserts on timings.

    python bench/corruption_checks.py [--runs 3] [--steps 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.commands import REPO, resil_run, train
from bench.common import read_events, select

VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "off": ([], {}),
    "m10-nocopy": (["--fingerprint-every", "10"], {"RESILD_DIVERGENCE_ROLLBACK": "0"}),
    "m10": (["--fingerprint-every", "10"], {}),
    "m1": (["--fingerprint-every", "1"], {}),
    "v10": (["--verify-every", "10"], {}),
    "v1": (["--verify-every", "1"], {}),
}


def one_run(name: str, steps: int, tmp: Path) -> dict[str, Any]:
    flags, env = VARIANTS[name]
    events = tmp / "events.jsonl"
    cmd = resil_run(
        "--events", str(events), "--run-dir", str(tmp / "run"), "--json", *flags,
        worker=train(steps), nodes=3, spares=0,
    )  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        return {"variant": name, "error": p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]}
    summary = json.loads(p.stdout)
    evs = read_events(events)
    copies = select(evs, "agreed_state")
    out: dict[str, Any] = {"variant": name, "step_ms": round(summary["job"]["step_s"] * 1000, 3)}
    verified = select(evs, "steps_verified")
    if verified:
        out["verified"] = statistics.median(v["verified"] for v in verified)
    if copies:
        out["copies"] = statistics.median(c["kept"] for c in copies)
        out["capture_ms"] = round(statistics.median(c["capture_s"] / max(1, c["kept"]) for c in copies) * 1000, 4)
        out["held_kb"] = round(statistics.median(c["held_bytes"] for c in copies) / 1024, 1)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    def med(name: str, key: str) -> float | None:
        xs = [r[key] for r in runs if r["variant"] == name and r.get(key) is not None]
        return statistics.median(xs) if xs else None

    base, nocopy = med("off", "step_ms"), med("m10-nocopy", "step_ms")
    out: dict[str, dict[str, Any]] = {}
    for name in VARIANTS:
        step = med(name, "step_ms")
        out[name] = {
            "step_ms": step,
            "ratio": round(step / base, 3) if step and base else None,
            "capture_ms": med(name, "capture_ms"),
            "held_kb": med(name, "held_kb"),
            "runs": len([r for r in runs if r["variant"] == name and "step_ms" in r]),
        }
    m10, v1 = out["m10"]["step_ms"], out["v1"]["step_ms"]
    out["m10"]["copy_ratio"] = round(m10 / nocopy, 3) if m10 and nocopy else None
    out["v1"]["per_verified_step"] = round(v1 / base - 1, 3) if v1 and base else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="rounds (each runs every variant once)")
    p.add_argument("--steps", type=int, default=600, help="steps per job")
    p.add_argument("--json", action="store_true", help="one JSON object: every run and the summary")
    a = p.parse_args(argv)
    if a.runs < 1 or a.steps < 20:
        p.error("--runs must be >= 1 and --steps >= 20")
    names = list(VARIANTS)
    runs: list[dict[str, Any]] = []
    for i in range(a.runs):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotated: no variant always first
        for name in order:
            with tempfile.TemporaryDirectory(prefix="resild-bench-corruption-") as d:
                r = one_run(name, a.steps, Path(d))
            runs.append(r)
            print(f"round {i + 1} {name}: {r}", file=sys.stderr, flush=True)
    summary = summarize(runs)
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}, indent=2))
    else:
        print(f"{'variant':<12}{'step_ms':>9}{'ratio':>8}{'capture_ms':>12}{'held_kb':>9}{'runs':>6}")
        for name, s in summary.items():
            cells = [s["step_ms"], s["ratio"], s["capture_ms"], s["held_kb"], s["runs"]]
            print(f"{name:<12}" + "".join(f"{'-' if c is None else c:>{w}}" for c, w in zip(cells, (9, 8, 12, 9, 6))))
        print(f"copy_ratio (m10 / m10-nocopy): {summary['m10'].get('copy_ratio')}")
        print(f"per_verified_step (v1 / off - 1): {summary['v1'].get('per_verified_step')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
