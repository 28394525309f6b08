"""The rank layout of an N-D mesh over resild's groups (mesh_layout): validation,
coordinates, the groups along each dimension and their labels, the replica map."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.worker.mesh_layout import MeshError, MeshLayout
from launcher.worker.replica_map import ReplicaMap


@pytest.mark.parametrize(
    ("world", "shape", "names", "words"),
    [
        (4, (), (), "0 dimension size(s)"),
        (4, (2, 2), ("shard",), "2 dimension size(s) but 1 name(s)"),
        (4, (4,), ("shard", "tp"), "1 dimension size(s) but 2 name(s)"),
        (4, (2, 2), ("shard", "shard"), "distinct and non-empty"),
        (4, (2, 2), ("shard", ""), "distinct and non-empty"),
        (4, (-1, -1), ("a", "b"), "one may be -1"),
        (4, (0, 4), ("a", "b"), "sizes must be positive"),
        (4, (-2, -2), ("a", "b"), "sizes must be positive"),
        (6, (-1, 4), ("replicate", "shard"), "world size 6 is not a multiple of 4"),
        (8, (2, 2), ("replicate", "shard"), "holds 4 ranks, the job has 8"),
        (4, (8,), ("shard",), "holds 8 ranks, the job has 4"),
    ],
)
def test_a_mesh_that_does_not_fit_is_refused_in_one_line_naming_the_problem(
    world: int, shape: tuple[int, ...], names: tuple[str, ...], words: str
) -> None:
    with pytest.raises(MeshError) as e:
        MeshLayout.build(world, shape, names)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_one_minus_one_takes_what_is_left_of_the_world() -> None:
    assert MeshLayout.build(8, (-1, 4), ("replicate", "shard")).shape == (2, 4)
    assert MeshLayout.build(8, [2, -1], ["shard", "tp"]).shape == (2, 4)
    assert MeshLayout.build(12, (2, -1, 3), ("replicate", "shard", "tp")).shape == (2, 2, 3)
    assert MeshLayout.build(5, (-1,), ("shard",)).shape == (5,)


def test_build_normalises_lists_to_tuples_and_keeps_the_names() -> None:
    m = MeshLayout.build(6, [2, 3], ["replicate", "shard"])
    assert m == MeshLayout((2, 3), ("replicate", "shard"))
    assert m.world_size == 6


@pytest.mark.parametrize("shape", [(6,), (2, 3), (3, 2), (2, 3, 4), (1, 5, 1)])
def test_coords_and_rank_at_are_inverse_and_row_major(shape: tuple[int, ...]) -> None:
    m = MeshLayout(shape, tuple(f"d{i}" for i in range(len(shape))))
    seen = []
    for r in range(m.world_size):
        c = m.coords(r)
        assert all(0 <= x < s for x, s in zip(c, shape))
        assert m.rank_at(c) == r
        seen.append(c)
    assert seen == sorted(seen)  # rank order is lexicographic order of coordinates (last dim fastest)


def test_a_one_dimensional_mesh_is_one_group_of_every_rank() -> None:
    m = MeshLayout.build(4, (4,), ("shard",))
    for r in range(4):
        assert m.group(0, r) == ("resild-shard-0", [0, 1, 2, 3])
    assert m.replicas() == ReplicaMap(((0,), (1,), (2,), (3,)))
    assert not m.has_replicas


@pytest.mark.parametrize(("world", "shard"), [(4, 2), (8, 4), (6, 3), (6, 1), (3, 3)])
def test_a_replicate_shard_mesh_has_the_legacy_hsdp_groups_and_labels(world: int, shard: int) -> None:
    m = MeshLayout.build(world, (-1, shard), ("replicate", "shard"))
    for r in range(world):
        s, row = r % shard, r // shard
        assert m.group(0, r) == (f"resild-replicate-{s}", [s + i * shard for i in range(world // shard)])
        assert m.group(1, r) == (f"resild-shard-{row}", [row * shard + j for j in range(shard)])
    assert m.replicas() == ReplicaMap.hsdp(world, shard)
    assert m.has_replicas == (world // shard > 1)


def test_a_three_dimensional_mesh_gives_each_rank_one_group_per_dimension() -> None:
    m = MeshLayout.build(12, (2, 3, 2), ("replicate", "shard", "tp"))
    # rank = rep * 6 + shard * 2 + tp; the label's index is the other coordinates, row-major
    assert m.coords(9) == (1, 1, 1)
    assert m.group(0, 9) == ("resild-replicate-3", [3, 9])  # (shard 1, tp 1): 1 * 2 + 1
    assert m.group(1, 9) == ("resild-shard-3", [7, 9, 11])  # (rep 1, tp 1): 1 * 2 + 1
    assert m.group(2, 9) == ("resild-tp-4", [8, 9])  # (rep 1, shard 1): 1 * 3 + 1
    assert m.group(2, 0) == ("resild-tp-0", [0, 1])
    assert m.replicas() == ReplicaMap(tuple((k, k + 6) for k in range(6)))
    assert m.has_replicas
    for dim in range(3):
        for r in range(12):
            label, ranks = m.group(dim, r)
            assert r in ranks and len(ranks) == m.shape[dim]
            assert all(m.group(dim, q) == (label, ranks) for q in ranks)


def test_without_a_replicate_dimension_every_rank_holds_a_state_of_its_own() -> None:
    m = MeshLayout.build(8, (2, 4), ("shard", "tp"))
    assert m.replicas() == ReplicaMap(tuple((r,) for r in range(8)))
    assert not m.has_replicas
    m.replicas().validate(8)


def test_a_replicate_dimension_of_size_one_is_no_replica() -> None:
    m = MeshLayout.build(4, (1, 4), ("replicate", "shard"))
    assert not m.has_replicas
    assert m.replicas() == ReplicaMap(((0,), (1,), (2,), (3,)))


@st.composite
def layouts(draw: st.DrawFn) -> MeshLayout:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    names = draw(st.permutations(["replicate", "shard", "tp", "cp"]))[: len(shape)]
    return MeshLayout.build(math.prod(shape), shape, names)


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_the_groups_along_each_dimension_partition_the_ranks(m: MeshLayout) -> None:
    for dim in range(len(m.shape)):
        groups: dict[str, list[int]] = {}
        for r in range(m.world_size):
            label, ranks = m.group(dim, r)
            assert r in ranks and len(ranks) == m.shape[dim]
            assert groups.setdefault(label, ranks) == ranks  # every member computes the same label and ranks
            assert all(
                m.coords(q)[:dim] + m.coords(q)[dim + 1 :] == m.coords(r)[:dim] + m.coords(r)[dim + 1 :] for q in ranks
            )
        assert sorted(r for g in groups.values() for r in g) == list(range(m.world_size))
        assert len(groups) == m.world_size // m.shape[dim]
    m.replicas().validate(m.world_size)


def test_a_mesh_shrinks_by_whole_replica_groups_held_on_one_node() -> None:
    hsdp = MeshLayout.build(6, (-1, 2), ("replicate", "shard"))
    assert hsdp.replica_ranks == 2
    assert hsdp.resize_refusal(per_node=2) is None and hsdp.resize_refusal(per_node=4) is None
    assert "does not fit whole on a node" in (hsdp.resize_refusal(per_node=1) or "")
    assert hsdp.resized(4) == MeshLayout((2, 2), ("replicate", "shard"))
    assert hsdp.resized(4).replicas().groups == ((0, 2), (1, 3))
    three_d = MeshLayout.build(8, (2, 2, 2), ("replicate", "shard", "tp"))
    assert three_d.replica_ranks == 4 and three_d.resized(12).shape == (3, 2, 2)
    assert "no 'replicate' dimension" in (MeshLayout.build(4, (4,), ("shard",)).resize_refusal(4) or "")
    inner = MeshLayout.build(4, (2, 2), ("shard", "replicate"))
    assert "not the outermost" in (inner.resize_refusal(4) or "")
