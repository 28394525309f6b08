"""Whether a node may hold ranks: qualification, before a spare that joined (or came
back) becomes eligible. Pure: the probes' verdict and the self-test in, a decision with
its reasons out.

Stricter than the everyday health verdict: a node that is merely degraded (a row remap
pending, ECC counts over the daemon's limits, a recent Xid the probe still reports) may
finish the work it holds, but it is not given new work.
"""

from __future__ import annotations

from dataclasses import dataclass

from resild.health.model import Verdict
from resild.health.selftest import SelfTest


@dataclass(frozen=True)
class Qualification:
    qualified: bool
    reasons: tuple[str, ...]


def qualification(verdict: Verdict, probe_reasons: list[str], selftest: SelfTest) -> Qualification:
    reasons: list[str] = []
    if verdict is not Verdict.HEALTHY:
        reasons += [f"health {verdict.value}: {r}" for r in probe_reasons] or [f"health {verdict.value}"]
    reasons += selftest.reasons()
    return Qualification(not reasons, tuple(reasons))
