"""A FATAL: a rank (or a node process) says the job cannot go on (pure policy).

Every rank computes the same plan (a state nobody holds, a setting the job cannot honour,
a worker command that cannot start), so a true FATAL comes from the ranks of every node
within moments. One node's word alone is no evidence about the job: it may be that node's
own fault, or its key misused. So (`on_fatal`, `lone_fatals`):

- from a spare (it trains nothing): the spare is dropped;
- from the ranks of two nodes, or from the job's only active node: the job stops;
- from one node alone: nothing yet; if no other node says it within `FATAL_ECHO_S`,
  that node is replaced like a failed one and suspected (not drained: no evidence
  against its hardware). A spare that takes its ranks and says it too is the second node.
"""

from __future__ import annotations

from collections.abc import Mapping

from resild.controller.policy import NOTHING, Action, Decision, on_node_failure
from resild.controller.view import ClusterView
from resild.events.schema import Detector
from resild.membership import NodeRole

FATAL_ECHO_S = 5.0  # ranks reach a job-wide FATAL within moments of each other; a lone one waits this long


def on_fatal(view: ClusterView, node_id: str, error: str, said: Mapping[str, tuple[float, str]]) -> Decision:
    """`said`: the nodes that said FATAL before in this job (node -> when, what), `node_id`
    not counted. -> stop the job, drop a spare, or nothing yet (`lone_fatals` decides later)."""
    node = view.nodes.get(node_id)
    if node is None or node.role in (NodeRole.FENCED, NodeRole.DONE):
        return NOTHING  # out of the job already: its word is not the job's
    if node.role == NodeRole.SPARE:
        why = f"spare {node_id} said the job cannot go on, and a spare trains nothing: {error}"
        return Decision(Action.DROP_SPARE, why, node=node_id, detector=Detector.RUNTIME.value)
    others = sorted(n for n in said if n != node_id)
    active = [n for n, v in view.nodes.items() if v.role == NodeRole.ACTIVE]
    if others or active == [node_id]:
        by = f" (said by {node_id} and {', '.join(others)})" if others else ""
        # no node named: the job's own fault, not a node's (a named one would be fenced as failed)
        return Decision(Action.FAIL_JOB, f"unrecoverable: {error}{by}", detector=Detector.RUNTIME.value)
    return NOTHING


def lone_fatals(now: float, view: ClusterView, said: Mapping[str, tuple[float, str]], echo_s: float) -> Decision:
    """The first node whose FATAL no other node echoed within `echo_s`: replaced, suspected."""
    for node_id, (t, error) in sorted(said.items(), key=lambda kv: kv[1][0]):
        node = view.nodes.get(node_id)
        if now - t < echo_s or node is None or node.role != NodeRole.ACTIVE:
            continue
        cause = f"its ranks alone said the job cannot go on (no other node did within {echo_s:.0f}s): {error}"
        return on_node_failure(view, node_id, cause, Detector.RUNTIME.value, worker_fault=True)
    return NOTHING
