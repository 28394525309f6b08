"""Shrink and grow as one process sees them (launcher.worker.resize): which shards a rank
computes to keep the global batch, which jobs can change width, the groups' names at each
width, and how the loop is told. The whole path runs in tests/launcher/run/test_resize.py."""

from __future__ import annotations

import pytest

from launcher.worker.mesh_layout import MeshLayout
from launcher.worker.resize import Resizer

pytestmark = pytest.mark.timeout(30)


def test_at_full_width_each_rank_computes_its_own_shard_at_weight_one() -> None:
    r = Resizer(full_world_size=4)
    assert [r.data_shards(rank, 4) for rank in range(4)] == [[0], [1], [2], [3]]
    assert r.shard_weight(4) == 1.0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shrunk_the_ranks_share_every_shard_of_the_full_width_once(world: int) -> None:
    r = Resizer(full_world_size=4)
    shards = [r.data_shards(rank, world) for rank in range(world)]
    assert sorted(s for mine in shards for s in mine) == [0, 1, 2, 3]
    assert all(mine[0] == rank for rank, mine in enumerate(shards))  # its own rank's shard first
    # each shard's loss scaled so that the ranks' average gradient is the full width's
    assert r.shard_weight(world) == world / 4


def test_three_of_four_ranks_spread_the_missing_ones_round_robin() -> None:
    r = Resizer(full_world_size=4)
    assert [r.data_shards(rank, 3) for rank in range(3)] == [[0, 3], [1], [2]]


def test_plain_data_parallelism_can_change_width() -> None:
    assert Resizer.refusal(False, None, per_node=2) is None
    assert Resizer.replica_ranks(None) == 1  # every rank is a replica


def test_a_job_with_its_own_replica_map_cannot_change_width() -> None:
    why = Resizer.refusal(True, MeshLayout.build(8, (2, 4), ("replicate", "shard")), per_node=4)
    assert why == "it gives its own replica map (shrinking needs job.mesh()'s or plain data parallelism)"


def test_a_mesh_can_change_width_only_when_a_node_holds_whole_replica_groups() -> None:
    hsdp = MeshLayout.build(8, (2, 4), ("replicate", "shard"))
    assert Resizer.replica_ranks(hsdp) == 4
    assert Resizer.refusal(False, hsdp, per_node=4) is None
    assert Resizer.refusal(False, hsdp, per_node=8) is None
    assert Resizer.refusal(False, hsdp, per_node=2) == hsdp.resize_refusal(2) is not None
    fsdp = MeshLayout.build(8, (8,), ("shard",))
    assert Resizer.refusal(False, fsdp, per_node=4) == fsdp.resize_refusal(4) is not None


def test_groups_keep_their_names_until_the_first_resize_then_take_new_ones_at_each_width() -> None:
    r = Resizer(full_world_size=4)
    assert r.name("world") == "world" and r.name("snapshots") == "snapshots"
    r.widths += 1
    assert r.name("world") == "world~1"
    r.widths += 1
    assert r.name("replicate") == "replicate~2"


def test_rank_0_says_the_resize_once_and_every_rank_runs_the_loops_callbacks_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[tuple[str, int, int]] = []
    r = Resizer(full_world_size=4)
    r.callbacks += [lambda old, new: seen.append(("sampler", old, new)), lambda old, new: seen.append(("lr", old, new))]
    r.resized(0, 4, 2)
    r.resized(1, 4, 2)
    assert seen == [("sampler", 4, 2), ("lr", 4, 2)] * 2
    assert capsys.readouterr().err == "resild: the job shrank from 4 to 2 ranks\n"
    r.resized(0, 2, 4)
    assert capsys.readouterr().err == "resild: the job grew from 2 to 4 ranks\n"
