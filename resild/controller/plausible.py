"""What the job has committed, as far as its nodes' reports vouch for it (pure).

A rank commits step k only once every rank voted for k, so every node reaches each step
within one of the others. The controller's committed step (a recovery's floor, the fault
schedule, the progress line) is therefore the second-highest node's claim: what at least
two nodes say. A node key that claims step 2^53 cannot raise it (a recovery would then
find no rank holding that step and stop the job), nor by one: a floor one past the truth
fails a recovery of a job whose reports are current. The count trails the newest commit
by a step and a report interval (0.1 s) at most, never runs ahead of it: a floor may only
err low. A job of one node is its own witness.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def corroborated(steps: Mapping[str, int], nodes: Iterable[str]) -> int:
    """`steps[node]`: the newest step its reports claim (absent: 0); `nodes`: the epoch's."""
    top = sorted((steps.get(n, 0) for n in nodes), reverse=True)
    return top[1] if len(top) > 1 else (top[0] if top else 0)
