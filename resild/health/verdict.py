"""Node verdict from per-GPU statuses (pure)."""

from __future__ import annotations

from collections.abc import Iterable

from resild.health.model import GpuStatus, Verdict, worst


def node_verdict(statuses: Iterable[GpuStatus], expected_gpus: int | None = None) -> tuple[Verdict, list[str]]:
    """Worst GPU verdict, with the reasons of every GPU that is not healthy.

    ``expected_gpus``: when given and fewer GPUs are visible, the node is
    FAILED — a GPU that vanished from enumeration reports nothing at all, so
    counting is the only way to see it (fail closed).
    """
    statuses = list(statuses)
    verdict = worst(*(s.verdict for s in statuses))
    reasons = [
        f"gpu{s.index}: {r}"
        for s in sorted(statuses, key=lambda s: s.index)
        if s.verdict is not Verdict.HEALTHY
        for r in (s.reasons or [s.verdict.value])
    ]
    if expected_gpus is not None and len(statuses) < expected_gpus:
        verdict = Verdict.FAILED
        reasons.insert(0, f"only {len(statuses)} of {expected_gpus} expected GPUs visible")
    return verdict, reasons
