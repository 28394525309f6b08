"""How many cold spares to ask the queue for (`resil-run --spare-target S`).

Pure: the pool as the view has it, the target, and the requests still on their way (queued,
or started but not yet joined). Asking is cheap and a surplus is cancelled at the end, but
asking twice for one gap would double the queue's load: requests on their way count as spares.
"""

from __future__ import annotations

from dataclasses import dataclass

from resild.controller.view import ClusterView

MAX_REQUEST = 16  # cold-spare jobs asked for at once (a burst of failures refills over a few rounds)


@dataclass(frozen=True)
class Refill:
    count: int
    reason: str


def refill(view: ClusterView, target: int, on_the_way: int) -> Refill:
    if target <= 0 or view.membership is None:
        return Refill(0, "no spare target" if target <= 0 else "the job has not started")
    pool = len(view.spares())  # admitted or started spares, warm or warming
    gap = target - pool - on_the_way
    if gap <= 0:
        return Refill(0, f"{pool} spare(s) and {on_the_way} on the way for a target of {target}")
    n = min(gap, MAX_REQUEST)
    return Refill(n, f"{pool} spare(s) and {on_the_way} on the way, below the target of {target}: asking for {n}")
