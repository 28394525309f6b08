from __future__ import annotations

import pytest
import torch

from launcher.worker.replica_map import NoReplica, ReplicaMap, Transfer, plan_replay
from launcher.worker.transport.codec import flatten, unflatten


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    for _ in range(5):
        opt.zero_grad()
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    return m, opt, sched


def test_round_trip_is_bitwise_and_keeps_key_types() -> None:
    m, opt, sched = _trained()
    state = {
        "model": m.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "tuple": (1, "x", None, 2.5, True),
    }
    skel, buf = flatten(state)
    assert buf.dtype == torch.uint8
    out = unflatten(skel, buf)
    assert set(out["optim"]["state"]) == {0, 1, 2, 3}  # int keys survive JSON
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k], v)
    for i, s in state["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(out["optim"]["state"][i][k], v)
    assert out["sched"] == state["sched"] and out["tuple"] == state["tuple"]
    assert torch.equal(out["rng"], state["rng"])


def test_restored_optimizer_continues_identically() -> None:
    m, opt, sched = _trained()
    skel, buf = flatten({"model": m.state_dict(), "optim": opt.state_dict()})
    torch.manual_seed(1)
    m2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    s = unflatten(skel, buf)
    m2.load_state_dict(s["model"])
    opt2.load_state_dict(s["optim"])
    x = torch.randn(3, 4)
    for mm, oo in ((m, opt), (m2, opt2)):
        oo.zero_grad()
        mm(x).sum().backward()
        oo.step()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_size_mismatch_is_an_error() -> None:
    skel, buf = flatten({"t": torch.ones(4)})
    with pytest.raises(ValueError, match="bytes"):
        unflatten(skel, buf[:-1])


def test_unsupported_state_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="cannot replay state of type"):
        flatten({"f": object()})


def test_plan_dp_spreads_sources() -> None:
    target, plan = plan_replay([7, 7, 0, 0], ReplicaMap.data_parallel(4))
    assert target == 7 and plan == [Transfer(0, 2), Transfer(1, 3)]


def test_plan_rank_that_missed_the_last_commit_catches_up() -> None:
    assert plan_replay([8, 7, 8, 8], ReplicaMap.data_parallel(4)) == (8, [Transfer(0, 1)])


def test_plan_hsdp_sends_each_shard_from_its_own_replica_group() -> None:
    rm = ReplicaMap.hsdp(4, shard_size=2)  # shards {0,2} and {1,3}
    assert plan_replay([5, 5, 0, 0], rm) == (5, [Transfer(0, 2), Transfer(1, 3)])


def test_plan_every_replica_of_a_shard_lost() -> None:
    with pytest.raises(NoReplica, match="disk checkpoint"):
        plan_replay([5, 0, 5, 0], ReplicaMap.hsdp(4, shard_size=2))


def test_replica_map_must_partition_the_ranks() -> None:
    ReplicaMap.hsdp(4, 2).validate(4)
    with pytest.raises(ValueError, match="partition"):
        ReplicaMap(((0, 2),)).validate(4)  # ranks 1 and 3 in no group
    with pytest.raises(ValueError, match="partition"):
        ReplicaMap(((0, 1), (1, 2, 3))).validate(4)
