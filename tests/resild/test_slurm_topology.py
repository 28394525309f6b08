"""Failure domains from Slurm's topology: neighbours in rank order (where snapshot
copies go) sit behind different leaf switches when the scheduler knows them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from resild.slurm import interleave_by_domain, parse_topology

TOPOLOGY = """SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-3]
SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n[4-6]
SwitchName=top Level=1 LinkSpeed=1 Nodes=n[1-6] Switches=s[0-1]
garbage line
SwitchName=bad Level=0 Nodes=n[
"""


def test_leaf_switches_are_read_and_upper_levels_ignored() -> None:
    assert parse_topology(TOPOLOGY) == {f"n{i}": ("s0" if i <= 3 else "s1") for i in range(1, 7)}
    assert parse_topology("") == {}


def test_neighbours_alternate_switches_and_the_batch_host_stays_first() -> None:
    nodes = [f"n{i}" for i in range(1, 7)]
    order = interleave_by_domain(nodes, parse_topology(TOPOLOGY))
    assert order == ["n1", "n4", "n2", "n5", "n3", "n6"]
    assert interleave_by_domain(nodes, {}) == nodes  # no topology: the allocation's order


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_interleaving_is_a_permutation_with_no_same_switch_neighbours_while_two_switches_remain(sw: list[int]) -> None:
    nodes = [f"n{i}" for i in range(len(sw))]
    domain = {n: f"s{d}" for n, d in zip(nodes, sw)}
    order = interleave_by_domain(nodes, domain)
    assert sorted(order) == sorted(nodes) and order[0] == nodes[0]
    counts = {d: sw.count(int(d[1:])) for d in set(domain.values())}
    if len(counts) > 1 and max(counts.values()) * 2 <= len(nodes) and len(set(counts.values())) == 1:
        # equal-sized domains: round-robin never puts two of one switch side by side
        assert all(domain[a] != domain[b] for a, b in zip(order, order[1:]))
