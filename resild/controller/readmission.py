"""Whether a node fenced on suspicion comes back to the job as a spare.

A node fenced without evidence against its hardware (a worker's exception or a hang:
`node_suspect`, not drained) is most often sound: the fault was the job's or a transient.
It still holds its place in the allocation, so it comes back as a spare, qualified first
(`resild check --qualify` in its new node process). A node fenced with evidence (Xid, ECC,
a lost GPU or host) is drained and never comes back in the same job; a re-admitted node
that fails again within the suspect window is drained (the second strike, policy.drain_verdict).

Pure: a function of `now`, the view, which nodes the backend can start again, and how
long the fenced incarnation must have been silent (none of it may still be running).
O(suspects) per call: only nodes with strikes are looked at.
"""

from __future__ import annotations

from dataclasses import dataclass

from resild.controller.view import ClusterView
from resild.membership import NodeRole


@dataclass(frozen=True)
class Readmission:
    node: str
    reason: str


def readmission(now: float, view: ClusterView, restartable: frozenset[str], quiet_s: float) -> Readmission | None:
    """The first suspect node ready to come back, or None. `restartable`: nodes whose old
    node process the backend knows to be gone and can start again; `quiet_s`: the fenced
    incarnation has not been heard for this long (a stopped process that wakes is fenced
    again, not taken for the new one)."""
    if view.membership is None:
        return None  # start-up: a node lost now is replaced, not waited for
    for node_id, strikes in view.strikes.items():
        node = view.nodes.get(node_id)
        if node is None or node.role != NodeRole.FENCED or node_id in view.drained or node_id not in restartable:
            continue
        if not strikes or now - max(strikes[-1], node.fenced_heard_s) < quiet_s:
            continue
        return Readmission(
            node_id,
            f"{node_id} was fenced without evidence against its hardware ({node.reason[:200]}): "
            "back as a spare once qualified",
        )
    return None
