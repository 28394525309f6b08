"""How a rank waits for its commit vote (`vote_mode`): the choice, the GradScaler
majority, and, over real gloo groups in threads, what a rank holds when its vote is
cut off in each mode (what the recovery's agreement then reads)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from launcher.worker.commit import CommitProtocol, ReplicasDisagree, VoteMode, inf_majority, vote_mode
from launcher.worker.recovery import agree
from launcher.worker.replica_map import ReplicaMap, Transfer, plan_replay
from launcher.worker.stable_group import Interrupts, StableGroup
from launcher.worker.step_state import StepState
from launcher.worker.torch_private import backend_group, hash_store
from launcher.worker.train_state import TrainState

pytestmark = pytest.mark.timeout(60)


# ---- the choice (pure) ------------------------------------------------------------------
def test_replicated_gloo_jobs_overlap_the_vote() -> None:
    c = vote_mode("auto", "gloo", ReplicaMap.data_parallel(4), 4, snapshots=False)
    assert c.mode is VoteMode.OVERLAPPED and "whole state" in c.reason


@pytest.mark.parametrize(
    "setting,backend,replicas,snapshots,why",
    [
        ("blocking", "gloo", ReplicaMap.data_parallel(4), False, "--commit-vote blocking"),
        ("auto", "gloo", ReplicaMap.hsdp(4, 2), False, "sharded"),
        ("auto", "gloo", ReplicaMap(((0,), (1,), (2,), (3,))), False, "sharded"),  # plain FSDP2
        ("auto", "gloo", ReplicaMap.data_parallel(4), True, "snapshots"),
        ("auto", "nccl", ReplicaMap.data_parallel(4), False, "NCCL"),
    ],
)
def test_everything_else_waits_for_the_vote(
    setting: str, backend: str, replicas: ReplicaMap, snapshots: bool, why: str
) -> None:
    c = vote_mode(setting, backend, replicas, 4, snapshots)
    assert c.mode is VoteMode.BLOCKING and why in c.reason


def test_the_inf_majority() -> None:
    assert inf_majority(0, 0, 4) == (0, False)
    assert inf_majority(1, 4, 4) == (1, False)
    assert inf_majority(0, 1, 3) == (0, False)  # rank 2 saw inf alone: it is the odd one
    assert inf_majority(1, 1, 3) == (0, True)
    assert inf_majority(0, 2, 3) == (1, True)
    with pytest.raises(ValueError, match="no majority"):
        inf_majority(0, 1, 2)


# ---- real gloo, ranks in threads ---------------------------------------------------------
def gloo_groups(n: int) -> list[StableGroup]:
    store = hash_store()
    inner: list[Any] = [None] * n

    def build(r: int) -> None:
        inner[r] = backend_group("gloo", store, r, n, timedelta(seconds=20), "127.0.0.1")

    ts = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out = []
    for r in range(n):
        g = StableGroup("world", list(range(n)), r, Interrupts())
        g.set_backend(inner[r])
        g.allow = True
        out.append(g)
    return out


def rank_protocol(g: StableGroup, mode: VoteMode, rank: int) -> CommitProtocol:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.full((3, 4), float(rank + 1))
    model(x).pow(2).sum().backward()  # each rank its own gradients: the sync averages them
    train = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    p = CommitProtocol(StepState(), train, g, g._intr, lambda: g._intr.error is not None)
    p.mode = mode
    return p


def weights(p: CommitProtocol) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in p.train.model.parameters()])


def run_ranks(fns: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)

    def go(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as e:  # the test reads it
            out[i] = e

    ts = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


@pytest.mark.parametrize("mode", [VoteMode.BLOCKING, VoteMode.OVERLAPPED])
def test_a_completed_vote_commits_the_same_state_in_both_modes(mode: VoteMode) -> None:
    gs = gloo_groups(2)
    ps = [rank_protocol(g, mode, r) for r, g in enumerate(gs)]
    assert run_ranks([p.vote for p in ps]) == [True, True]
    ref = [rank_protocol(g, VoteMode.BLOCKING, r) for r, g in enumerate(gloo_groups(2))]
    assert run_ranks([p.vote for p in ref]) == [True, True]
    for p, q in zip(ps, ref):
        assert p.steps.step == 1 and torch.equal(weights(p), weights(q))
    assert torch.equal(weights(ps[0]), weights(ps[1]))


@pytest.mark.parametrize("mode", [VoteMode.BLOCKING, VoteMode.OVERLAPPED])
def test_a_vote_cut_off_leaves_the_rank_where_the_agreement_expects_it(mode: VoteMode) -> None:
    """Rank 1 syncs but never votes (its node froze); the epoch is then interrupted."""
    gs = gloo_groups(2)
    p0, p1 = (rank_protocol(g, mode, r) for r, g in enumerate(gs))
    before = weights(p0).clone()
    timer = threading.Timer(0.5, gs[0]._intr.fail, args=("a newer epoch",))
    timer.start()
    try:
        out = run_ranks([p0.vote, p1.sync])
    finally:
        timer.cancel()
        # rank 1's half of the vote, late: gloo's thread on rank 0 finishes instead of timing out
        gs[1]._inner.allreduce([torch.zeros(2, dtype=torch.int64)]).wait()
    assert out[0] is False
    if mode is VoteMode.BLOCKING:
        # in doubt: prepared, nothing applied; it rolls forward only if someone committed
        assert torch.equal(weights(p0), before) and p0.steps.agreement_row() == (0, 1, 0)
    else:
        # stepped during the vote: it holds step 1, and the agreement counts it as such
        assert not torch.equal(weights(p0), before) and p0.steps.agreement_row() == (1, 0, 0)
        ag = agree([list(p0.steps.agreement_row()), [0, 0, -1]])
        assert ag.target == 1 and plan_replay(ag.steps, ReplicaMap.data_parallel(2)) == (1, [Transfer(0, 1)])


def _seeing_inf(p: CommitProtocol) -> CommitProtocol:
    p.train.local_found_inf = lambda: 1  # type: ignore[method-assign]
    return p


def test_a_rank_outvoted_on_inf_nan_leaves_and_the_majority_commits() -> None:
    gs = gloo_groups(3)
    ps = [rank_protocol(g, VoteMode.OVERLAPPED, r) for r, g in enumerate(gs)]
    _seeing_inf(ps[2])
    out = run_ranks([p.vote for p in ps])
    assert out[:2] == [True, True]
    assert isinstance(out[2], ReplicasDisagree) and not out[2].no_majority
    assert "rank 2" in str(out[2]) and "1 of 3" in str(out[2])


def test_two_replicas_that_disagree_on_inf_nan_have_no_majority() -> None:
    gs = gloo_groups(2)
    ps = [rank_protocol(g, VoteMode.OVERLAPPED, r) for r, g in enumerate(gs)]
    _seeing_inf(ps[1])
    out = run_ranks([p.vote for p in ps])
    assert all(isinstance(e, ReplicasDisagree) and e.no_majority for e in out)
