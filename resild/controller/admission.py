"""Whether nodes asking to join a running job (`resil-run --join`) become its spares.

Pure: a function of the view and the request, returning an Admission with its reason.
A refusal changes nothing in the job; the reason is what both sides print.
"""

from __future__ import annotations

from dataclasses import dataclass

from resild.controller.view import ClusterView
from resild.wire.keys import NODE_NAME, RESERVED

MAX_JOIN = 64  # nodes in one request (an sbatch array task is one node; --local says --nodes)
# Spares admitted that have not registered yet: a joiner gone wrong (a loop, a dead array)
# must not grow the job's view without bound; registered spares are not limited.
MAX_PENDING = 256


@dataclass(frozen=True)
class Admission:
    admit: bool
    reason: str
    nodes: tuple[str, ...] = ()


def admission(
    view: ClusterView, job_id: str, asked_job: str, names: list[str], *, over: bool, keyed: bool = True
) -> Admission:
    """`job_id`: this controller's job; `asked_job`: the one the joiner's run directory names;
    `over`: the job has its verdict (no node joins a job that is ending); `keyed`: the
    controller authenticates its peers (a job without keys cannot tell who asks)."""
    if not keyed:
        return Admission(False, "this job runs without keys: a joining node cannot be authenticated")
    if not job_id:
        return Admission(False, "this job takes no joining nodes (it was started without a join key)")
    if asked_job != job_id:
        return Admission(False, f"this controller runs job {job_id}, not {asked_job!r}: a stale run directory?")
    if over:
        return Admission(False, f"job {job_id} is ending")
    if not names:
        return Admission(False, "no node named")
    if len(names) > MAX_JOIN:
        return Admission(False, f"{len(names)} nodes in one request (at most {MAX_JOIN})")
    if len(set(names)) != len(names):
        return Admission(False, "a node is named twice")
    pending = sum(1 for v in view.spares() if not v.registered)
    if pending + len(names) > MAX_PENDING:
        return Admission(False, f"{pending} spares admitted earlier have not registered yet (at most {MAX_PENDING})")
    for n in names:
        if not NODE_NAME.fullmatch(n) or n in RESERVED:
            return Admission(False, f"{n[:64]!r} cannot name a node (letters, digits, _ . - only)")
        known = view.nodes.get(n)
        if known is not None:
            # A fenced node never rejoins under its old name (issue: re-admission is qualified).
            return Admission(False, f"{n} is already a node of job {job_id} ({known.role.value})")
    return Admission(True, f"{', '.join(names)} joined job {job_id} as spares", tuple(names))
