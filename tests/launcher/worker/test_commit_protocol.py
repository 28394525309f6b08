"""Pure parts of the commit/recovery protocol: the step agreement with roll-forward,
multi-source replay plans, slicing; and the data cursor that rewinds without
touching the training RNG."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from launcher.worker.data import ResumableLoader
from launcher.worker.recovery import agree
from launcher.worker.replica_map import NoReplica, ReplicaMap, Transfer, plan_replay, slice_bounds
from launcher.worker.transport.codec import flatten, unflatten

pytestmark = pytest.mark.timeout(60)


def test_agreement_rolls_forward_prepared_ranks_when_someone_committed() -> None:
    # rank 0 committed step 8 (vote completed there, found_inf 1); ranks 1, 2 voted
    # but their vote was cut off; rank 3 is a fresh spare.
    ag = agree([[8, 0, 1], [7, 1, -1], [7, 1, -1], [0, 0, -1]])
    assert ag.target == 8 and ag.rollers == [1, 2] and ag.found_inf == 1
    assert ag.steps == [8, 8, 8, 0]


def test_prepared_ranks_roll_forward_to_a_step_whose_only_committer_died() -> None:
    # The controller saw step 8 committed; the rank that committed it is gone.
    ag = agree([[7, 1, 0], [7, 1, 1], [0, 0, -1]], floor=8)
    assert ag.target == 8 and ag.rollers == [0, 1] and ag.found_inf == 1 and ag.steps == [8, 8, 0]
    # Without that knowledge the prepared gradients are discarded.
    assert agree([[7, 1, 0], [7, 1, 0], [0, 0, -1]]).target == 7


def test_agreement_discards_prepared_gradients_when_nobody_committed() -> None:
    ag = agree([[7, 1, 0], [7, 1, 0], [7, 0, 0], [0, 0, -1]])
    assert ag.target == 7 and ag.rollers == [] and ag.steps == [7, 7, 7, 0]


def test_an_unprepared_rank_one_step_behind_receives_state_instead() -> None:
    ag = agree([[8, 0, 0], [7, 0, -1]])
    assert ag.rollers == [] and ag.steps == [8, 7]
    assert plan_replay(ag.steps, ReplicaMap.data_parallel(2)) == (8, [Transfer(0, 1)])


def test_multi_source_plan_gives_each_receiver_disjoint_slices_from_distinct_holders() -> None:
    target, plan = plan_replay([5, 5, 5, 0, 0, 5], ReplicaMap.data_parallel(6), max_sources=2)
    assert target == 5
    for dst in (3, 4):
        mine = [t for t in plan if t.dst == dst]
        assert sorted(t.part for t in mine) == [0, 1] and all(t.parts == 2 for t in mine)
        assert len({t.src for t in mine}) == 2
    # the load is spread: no holder sends more than two slices
    assert max(sum(t.src == s for t in plan) for s in (0, 1, 2, 5)) <= 2


def test_hsdp_plan_uses_only_holders_of_the_same_shard() -> None:
    rm = ReplicaMap.hsdp(8, shard_size=4)
    _, plan = plan_replay([3, 3, 0, 0, 3, 3, 3, 3], rm, max_sources=2)
    assert {(t.src, t.dst) for t in plan} == {(6, 2), (7, 3)}  # one other replica each: one source
    with pytest.raises(NoReplica):
        plan_replay([0, 3, 3, 3, 0, 3, 3, 3], rm)


@pytest.mark.parametrize("n,parts", [(0, 2), (1, 2), (10, 3), (1 << 20, 4)])
def test_slices_cover_the_buffer_exactly(n: int, parts: int) -> None:
    spans = [slice_bounds(n, p, parts) for p in range(parts)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def _rng() -> str:
    return hashlib.md5(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _loader() -> ResumableLoader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = TensorDataset(torch.arange(40.0).view(20, 2))
    return ResumableLoader(
        StatefulDataLoader(
            ds, batch_size=3, sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
        )
    )


@pytest.mark.parametrize("consumed", [1, 3, 4, 9])
def test_resumable_loader_resumes_exactly_across_epochs_and_never_touches_the_rng(consumed: int) -> None:
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    a = _loader()
    for _ in range(consumed):
        next(a)
    skel, buf = flatten(a.state_dict())  # the replay path: JSON skeleton + bytes
    expected = [next(a)[0].tolist() for _ in range(5)]
    b = _loader()
    torch.manual_seed(1)
    before = _rng()
    b.load_state_dict(unflatten(skel, buf))
    b.state_dict()  # asked right after loading (resild captures it)
    got = [next(b)[0].tolist() for _ in range(5)]
    assert got == expected
    assert _rng() == before


SOLO_TWICE = """
import torch, launcher
m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
job = launcher.init(m, opt)
for step in job.steps(3):
    m(torch.ones(1, 2)).sum().backward()
    job.commit()
    job.commit()
"""


SOLO_OUTSIDE = """
import torch, launcher
m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)
job = launcher.init(m, opt)
m(torch.ones(1, 2)).sum().backward()
job.commit()
"""


def test_committing_outside_the_loop_is_a_clear_error(tmp_path) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", SOLO_OUTSIDE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode != 0
    assert "job.commit() outside the training loop" in p.stderr


def test_committing_twice_in_one_step_is_a_clear_error(tmp_path) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", SOLO_TWICE], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode != 0
    assert "job.commit() called twice in step 0" in p.stderr
