"""Taking over from a journal, as a pure fold: `reduce(apply, records, initial)`.

What a journal says about the job: each node's role (and why it was fenced), the
first epoch's layout with its start-up replacements, the current epoch with its
committed floor, the highest committed step, the verdict if there is one and the
faults already fired. Everything else comes back from the nodes, which re-register
with a new leader.

The fold is pure; `snapshot` is where it starts from and `take_over` the one step
that applies its result to the controller's shared state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import reduce
from typing import TYPE_CHECKING

from resild.controller.records import (
    Admit,
    DropSpare,
    FailJob,
    FaultFired,
    Finish,
    Grow,
    Readmit,
    Record,
    Reform,
    ReplaceNode,
    ReplicaUnit,
    Shrink,
    Start,
)
from resild.controller.view import JobResult, NodeView
from resild.membership import Membership, NodeRole, check_transition

if TYPE_CHECKING:
    from resild.controller.state import ControllerState

_LIVE = (NodeRole.ACTIVE, NodeRole.SPARE)


@dataclass(frozen=True)
class Restored:
    roles: dict[str, NodeRole]
    reasons: dict[str, str]  # why each node was fenced ("" for the others)
    initial: Membership  # the first epoch's layout (start-up replacements applied)
    membership: Membership | None = None  # the current epoch, once the job started
    max_step: int = 0
    result: JobResult | None = None
    fired: frozenset[str] = frozenset()  # specs of the faults that fired (once, ever)
    # Faults fired after the last decision: the old leader may have died between journaling
    # one and sending it, so a new leader fires them again (a fault that did hit finds its
    # worker dead or stopped already, or its node fenced: firing twice changes nothing).
    unsettled: frozenset[str] = frozenset()
    replica_ranks: int = 0  # ranks per replica group, as rank 0 said (0: not said)


def _set(s: Restored, node: str, role: NodeRole, reason: str = "") -> Restored:
    check_transition(s.roles[node], role)
    reasons = {**s.reasons, node: reason} if reason else s.reasons
    return replace(s, roles={**s.roles, node: role}, reasons=reasons)


def apply(s: Restored, rec: Record) -> Restored:
    """The state after one more record; records of other kinds (leader, unknown) change nothing."""
    if isinstance(rec, FaultFired):
        return replace(s, fired=s.fired | {rec.spec}, unsettled=s.unsettled | {rec.spec})
    if isinstance(rec, ReplicaUnit):
        return replace(s, replica_ranks=rec.ranks)
    if isinstance(rec, Start):
        return replace(s, membership=rec.membership, unsettled=frozenset())
    if isinstance(rec, Readmit):  # a suspect node back as a spare
        if s.roles.get(rec.node) == NodeRole.FENCED:
            return _set(replace(s, reasons={**s.reasons, rec.node: ""}), rec.node, NodeRole.SPARE)
        return s
    if isinstance(rec, Admit):  # joined spares (a name the job knew is never admitted twice)
        new = [n for n in rec.nodes if n not in s.roles]
        return replace(
            s, roles={**s.roles, **dict.fromkeys(new, NodeRole.SPARE)}, reasons={**s.reasons, **dict.fromkeys(new, "")}
        )
    if not isinstance(rec, (ReplaceNode, DropSpare, Shrink, Grow, Reform, FailJob, Finish)):
        return s
    s = replace(s, unsettled=frozenset())
    node, spare = rec.node, rec.spare
    if isinstance(rec, (ReplaceNode, DropSpare, Shrink, FailJob)) and node in s.roles and s.roles[node] in _LIVE:
        s = _set(s, node, NodeRole.FENCED, rec.reason)
    if isinstance(rec, (ReplaceNode, Grow)) and spare in s.roles:
        if s.roles[spare] == NodeRole.SPARE:
            s = _set(s, spare, NodeRole.ACTIVE)
        if rec.membership is None and isinstance(rec, ReplaceNode):  # a start-up replacement
            s = replace(s, initial=s.initial.replace(node or "", spare, next_epoch=False))
    if rec.membership is not None and isinstance(rec, (ReplaceNode, Shrink, Grow, Reform)):
        # The epoch's committed floor is its decision's committed step (a record written
        # before the membership carried it has only that): a new leader announces the same.
        floor = max(rec.membership.committed, rec.committed_step)
        s = replace(s, membership=rec.membership.with_committed(floor))
    s = replace(s, max_step=max(s.max_step, rec.committed_step))
    if isinstance(rec, FailJob):
        s = replace(s, result=JobResult(1, rec.reason))
    elif isinstance(rec, Finish):
        s = replace(s, result=JobResult(0, rec.reason))
    return s


def fold(records: Iterable[Record], initial: Restored) -> Restored:
    return reduce(apply, records, initial)


def initial(s: ControllerState) -> Restored:
    """Where the fold starts: the controller's state before it read the journal."""
    nodes = s.view.nodes
    return Restored(
        {n: v.role for n, v in nodes.items()},
        {n: v.reason for n, v in nodes.items()},
        s.initial,
        s.view.membership,
        s.max_step,
        s.result,
        replica_ranks=s.view.replica_ranks,
    )


def resume(s: ControllerState, r: Restored) -> None:
    """The folded journal as a new run of the job starts from it (resil-run --resume: every
    node process and worker is new, the training state comes from the checkpoint): fenced
    nodes stay fenced, promoted spares stay active, fired faults stay fired; the first epoch
    is the layout the job had last, announced once every active worker has registered."""
    nodes = s.view.nodes
    _add_joined(s, r, 0.0)
    for node_id, role in r.roles.items():
        _become(nodes[node_id], role)
        nodes[node_id].reason = r.reasons[node_id]
    last = r.membership or r.initial
    s.initial = Membership(1, last.world_size, dict(last.node_ranks))
    s.view.membership = None
    s.max_step, s.result = 0, None
    s.unregistered = sum(nodes[n].nproc for n in s.initial.node_ranks)


def _become(node: NodeView, role: NodeRole) -> None:
    """The role the journal gives `node`, by legal transitions: an active node the journal
    fenced and then re-admitted goes through FENCED."""
    if node.role == role:
        return
    if role == NodeRole.SPARE and node.role == NodeRole.ACTIVE:
        node.set_role(NodeRole.FENCED)
    node.set_role(role)


def _add_joined(s: ControllerState, r: Restored, now: float) -> None:
    """Nodes the journal admitted (`resil-run --join`) that this controller did not start with."""
    for node_id in r.roles:
        if node_id not in s.view.nodes:
            s.view.add(NodeView(node_id, NodeRole.SPARE, s.bc.nproc), now)


def take_over(s: ControllerState, r: Restored, now: float) -> None:
    """The folded journal applied to the controller's shared state: roles and reasons,
    the epochs, the step and the verdict; every live node counts as registered (silent
    from now on means lost) under the identity node processes give every replica."""
    nodes = s.view.nodes
    _add_joined(s, r, now)
    for node_id, role in r.roles.items():
        _become(nodes[node_id], role)
        nodes[node_id].reason = r.reasons[node_id]
    s.initial, s.view.membership = r.initial, r.membership
    s.max_step, s.result = r.max_step, r.result
    s.view.replica_ranks = r.replica_ranks
    m = s.view.membership
    for n in s.view.nodes.values():
        if n.role in (NodeRole.ACTIVE, NodeRole.SPARE):
            n.registered = True  # known from before: silent from now on means lost
            s.view.beat(n.node_id, now)
    # No routing ids: each of a node process's sockets has a random one, learnt from the
    # heartbeats it sends every replica; a node is reached once it is heard (handlers:
    # the lease first, so it follows us before anything else we send arrives).
    s.node_ident.clear()
    s.unregistered = sum(s.view.nodes[n].nproc for n in s.initial.node_ranks)
    if m is not None:
        s.bc.set_layout(m)
        # The hang clock starts at the takeover: ranks blocked then report again.
        s.view.epoch_started_s = s.view.last_commit_s = now
        s.awaiting_full_strength = m.epoch
