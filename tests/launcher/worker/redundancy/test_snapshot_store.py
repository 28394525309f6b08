"""Peer-memory snapshots (snapshots): where the copies go, a frozen state and its
checksum, what a rank holds, and the rollback plan (pure: no processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.worker.redundancy.snapshot_store import (
    HEADER_LEN,
    Fetch,
    Frozen,
    NoSnapshot,
    PlacementError,
    SnapshotStore,
    check_placement,
    holders,
    plan_rollback,
    sources,
)
from launcher.worker.transport.codec import checksum, skeleton
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import Mac


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same structure, same types, tensors equal byte for byte (NaN payloads included)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
            b.contiguous().reshape(-1).view(torch.uint8).numpy()
        )
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and list(a) == list(b)
            and all(type(k) is type(j) for k, j in zip(a, b))
            and all(bitwise_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def nested_state(seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 4, generator=g)
    w[0, 0] = float("nan")
    state = {
        "model": {
            "w32": w,
            "w64": torch.randn(5, generator=g, dtype=torch.float64),
            "w16": torch.randn(2, 3, generator=g).half(),
            "bf16": torch.randn(4, generator=g).bfloat16(),
            "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # not contiguous
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 4, generator=g)}, 1: {}},
            "param_groups": [{"lr": 0.01, "params": [0, 1], "betas": (0.9, 0.999), "name": None}],
        },
        "ints": [
            torch.tensor([-(2**62), 2**62], dtype=torch.int64),
            torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
            torch.tensor([-7, 300], dtype=torch.int16),
            torch.tensor([-128, 127], dtype=torch.int8),
            torch.tensor([0, 255], dtype=torch.uint8),
            torch.tensor([True, False, True]),
        ],
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    aux = {"rng": torch.Generator().manual_seed(seed + 1).get_state(), "step": 5, "data": ("epoch", 2)}
    return state, aux


# ---- placement -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "per_node", "copies"), [(2, 1, 1), (4, 1, 3), (8, 2, 1), (8, 2, 3), (12, 3, 2), (6, 3, 1)]
)
def test_holders_and_sources_are_inverse_and_never_on_the_ranks_own_node(
    world: int, per_node: int, copies: int
) -> None:
    check_placement(world, per_node, copies)
    held_by: dict[int, set[int]] = {r: set() for r in range(world)}
    for r in range(world):
        hs = holders(r, world, per_node, copies)
        assert len(hs) == copies
        nodes = {h // per_node for h in hs}
        assert len(nodes) == copies and r // per_node not in nodes  # each copy on another node
        assert all(h % per_node == r % per_node for h in hs)  # same local rank on the next nodes
        for h in hs:
            held_by[h].add(r)
    for r in range(world):
        assert set(sources(r, world, per_node, copies)) == held_by[r]
        for k, s in enumerate(sources(r, world, per_node, copies)):
            assert holders(s, world, per_node, copies)[k] == r  # the k-th source sends its k-th copy here


def test_the_k_th_copy_goes_to_the_k_th_next_node_wrapping_around() -> None:
    assert holders(0, 8, 2, 2) == [2, 4]
    assert holders(7, 8, 2, 2) == [1, 3]
    assert sources(1, 8, 2, 2) == [7, 5]


@pytest.mark.parametrize(
    ("world", "per_node", "copies", "words"),
    [
        (4, 1, -1, "--snapshot-copies must be >= 0, not -1"),
        (4, 2, 2, "--snapshot-copies 2 needs at least 3 active nodes"),
        (4, 4, 1, "this job has 1"),
        (1, 1, 1, "needs at least 2 active nodes"),
        (6, 4, 1, "--snapshot-copies 1"),  # ranks do not fill whole nodes
        (4, 0, 1, "--snapshot-copies 1"),
    ],
)
def test_a_placement_the_job_cannot_hold_is_refused_naming_the_fix(
    world: int, per_node: int, copies: int, words: str
) -> None:
    with pytest.raises(PlacementError) as e:
        check_placement(world, per_node, copies)
    msg = str(e.value)
    assert words in msg and "\n" not in msg
    if copies > 0:
        assert "lower --snapshot-copies or add nodes" in msg


def test_no_copies_fit_any_job() -> None:
    for world, per_node in [(1, 1), (4, 4), (6, 4), (3, 0)]:
        check_placement(world, per_node, 0)
    check_placement(4, 1, 3)


# ---- a frozen state ------------------------------------------------------------------


def test_a_frozen_state_thaws_bitwise_into_the_same_nested_structure() -> None:
    state, aux = nested_state()
    f = Frozen.capture(5, 3, state, aux)
    assert (f.step, f.src, f.crc) == (5, 3, -1)
    assert f.payload.dtype == torch.uint8 and f.nbytes == f.payload.numel()
    got_state, got_aux = f.thaw()
    assert bitwise_equal(got_state, state)
    assert bitwise_equal(got_aux, aux)
    assert set(got_state["optim"]["state"]) == {0, 1}  # int keys stay int


def test_a_frozen_state_thaws_into_the_live_tensors_of_the_same_path_and_new_memory_elsewhere() -> None:
    state, aux = nested_state()
    f = Frozen.capture(5, 3, state, aux)
    live, _ = nested_state(seed=1)  # the same structure, other values: a rank's live state
    live["model"]["w16"] = torch.zeros(3, 2).half()  # another shape: not written
    live["optim"]["state"][0]["exp_avg"] = torch.zeros(4, 3)  # another shape
    del live["ints"]  # no such path
    kept = {k: live["model"][k] for k in ("w32", "t", "w16")}
    w16_before = kept["w16"].clone()
    got, got_aux, written, landed = f.thaw_into(live)
    assert bitwise_equal(got, state) and bitwise_equal(got_aux, aux)
    assert got["model"]["w32"] is not state["model"]["w32"]
    assert got["model"]["w32"].data_ptr() == kept["w32"].data_ptr()  # written in place
    assert got["model"]["t"].data_ptr() == kept["t"].data_ptr() and not kept["t"].is_contiguous()
    assert bitwise_equal(kept["w32"], state["model"]["w32"]) and bitwise_equal(kept["t"], state["model"]["t"])
    assert got["model"]["w16"].data_ptr() != kept["w16"].data_ptr() and torch.equal(kept["w16"], w16_before)
    assert got["ints"][0].data_ptr() != state["ints"][0].data_ptr()  # new memory, not the source's
    not_live = state["model"]["w16"].nbytes + state["optim"]["state"][0]["exp_avg"].nbytes
    not_live += sum(t.nbytes for t in state["ints"])
    assert written == sum(t.nbytes for t in skeleton(state)[1]) - not_live and landed == 0
    assert f.thaw_into(None)[2] == 0


def test_a_frozen_state_thaws_what_has_no_live_home_into_memory_a_spare_touched() -> None:
    g = torch.Generator().manual_seed(2)
    state = {"model": {"w": torch.randn(200, 100, generator=g)}, "optim": {"m": torch.randn(100, 200, generator=g)}}
    f = Frozen.capture(5, 3, state, {})
    live = {"model": {"w": torch.zeros(200, 100)}}  # a spare: its model built, its optimizer empty
    landing = LandingPool()
    pads = [torch.zeros(100, 200), torch.zeros(200, 100)]  # the moment's shape, and the weight's
    assert all(landing.add(p) for p in pads)
    got, _, written, landed = f.thaw_into(live, landing)
    assert bitwise_equal(got, state)
    assert got["model"]["w"].data_ptr() == live["model"]["w"].data_ptr()  # a live home comes first
    assert got["optim"]["m"].data_ptr() == pads[0].data_ptr()
    assert (written, landed) == (state["model"]["w"].nbytes, state["optim"]["m"].nbytes)
    assert len(landing) == 1 and landing.take(torch.float32, (200, 100), torch.device("cpu")) is pads[1]


def test_capture_copies_now_so_the_next_optimizer_step_does_not_change_the_snapshot() -> None:
    state, aux = nested_state()
    before = {k: v.clone() for k, v in state["model"].items()}
    f = Frozen.capture(1, 0, state, aux).seal()
    state["model"]["w32"].add_(1.0)
    state["model"]["bf16"].zero_()
    assert f.verify()
    assert bitwise_equal(f.thaw()[0]["model"], before)


def test_seal_computes_the_checksum_once_and_verify_needs_it() -> None:
    f = Frozen.capture(2, 0, *nested_state())
    assert not f.verify()  # not sealed yet: not a complete copy
    assert f.seal() is f and f.crc >= 0 and f.verify()
    crc = f.crc
    f.payload[0] ^= 1
    assert f.seal().crc == crc  # sealing again does not bless the damage
    assert not f.verify()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_flipped_byte_fails_verify(where: str) -> None:
    f = Frozen.capture(2, 0, *nested_state()).seal()
    i = {"first": 0, "middle": f.nbytes // 2, "last": f.nbytes - 1}[where]
    f.payload[i] ^= 0x01
    assert not f.verify()
    f.payload[i] ^= 0x01
    assert f.verify()


def test_the_header_describes_an_empty_copy_that_receives_the_payload() -> None:
    f = Frozen.capture(9, 2, *nested_state())
    h = f.header()
    assert h.dtype == torch.int64 and h.numel() == HEADER_LEN
    assert f.crc >= 0  # the header seals
    e = Frozen.empty_from([int(x) for x in h.tolist()])
    assert (e.step, e.src, e.crc, e.n_skel, e.n_askel, e.n_abuf, e.nbytes) == (
        f.step,
        f.src,
        f.crc,
        f.n_skel,
        f.n_askel,
        f.n_abuf,
        f.nbytes,
    )
    e.payload.copy_(f.payload)
    assert e.verify()
    assert bitwise_equal(e.thaw(), f.thaw())


def test_a_state_without_tensors_round_trips() -> None:
    f = Frozen.capture(0, 0, {"step": 0, "names": ["a", "b"]}, {}).seal()
    assert f.verify()
    assert f.thaw() == ({"step": 0, "names": ["a", "b"]}, {})


# ---- what a rank holds ---------------------------------------------------------------


def frozen(step: int, src: int, size: int = 8) -> Frozen:
    return Frozen.capture(step, src, {"w": torch.full((size,), float(src * 100 + step))}, {"step": step}).seal()


def test_a_store_keeps_its_own_and_held_copies_by_source_and_step() -> None:
    s = SnapshotStore(rank=1)
    own4, own5, held4 = frozen(4, 1), frozen(5, 1), frozen(4, 0)
    s.keep_own(own4)
    s.keep_own(own5)
    s.keep_held(held4)
    assert s.get(1, 4) is own4 and s.get(1, 5) is own5 and s.get(0, 4) is held4
    assert s.get(0, 5) is None and s.get(2, 4) is None
    assert s.nbytes == own4.nbytes + own5.nbytes + held4.nbytes
    assert sorted(s.verified_inventory()) == [(0, 4), (1, 4), (1, 5)]
    assert s.corrupt_found == []


def test_confirm_drops_older_snapshots_and_drop_after_drops_newer_ones() -> None:
    s = SnapshotStore(rank=0)
    for step in (3, 4, 5):
        s.keep_own(frozen(step, 0))
        s.keep_held(frozen(step, 2))
    s.confirm(4)
    assert sorted(s.own) == [4, 5] and sorted(s.held[2]) == [4, 5]
    s.drop_after(4)
    assert sorted(s.own) == [4] and sorted(s.held[2]) == [4]
    assert sorted(s.verified_inventory()) == [(0, 4), (2, 4)]


def test_forget_removes_one_copy_own_or_held() -> None:
    s = SnapshotStore(rank=0)
    s.keep_own(frozen(4, 0))
    s.keep_held(frozen(4, 1))
    s.forget(1, 4)
    assert s.get(1, 4) is None and s.get(0, 4) is not None
    s.forget(0, 4)
    assert s.get(0, 4) is None
    s.forget(7, 4)  # nothing held of rank 7: no error
    assert s.nbytes == 0


def test_corrupt_now_damages_what_is_held_and_what_arrives_later_but_not_the_own_copies() -> None:
    s = SnapshotStore(rank=1)
    s.keep_own(frozen(4, 1))
    s.keep_held(frozen(4, 0))
    s.corrupt_now()
    s.keep_held(frozen(5, 0))
    s.keep_held(frozen(5, 3))
    assert s.verified_inventory() == [(1, 4)]
    assert sorted(s.corrupt_found) == [(0, 4), (0, 5), (3, 5)]
    assert s.get(0, 4) is None and s.get(0, 5) is None and s.get(3, 5) is None  # dropped, never offered


def test_a_store_that_corrupts_what_it_holds_drops_it_at_verification() -> None:
    s = SnapshotStore(rank=1, corrupt_held=True)
    s.keep_held(frozen(4, 0))
    assert s.verified_inventory() == []
    assert s.corrupt_found == [(0, 4)]


def test_an_own_copy_the_exchange_never_sealed_is_sealed_and_offered_but_an_unsealed_held_one_is_not() -> None:
    s = SnapshotStore(rank=0)
    s.keep_own(Frozen.capture(4, 0, {"w": torch.ones(2)}, {}))  # crc -1: its exchange never ran
    s.keep_own(frozen(3, 0))
    s.keep_held(Frozen.capture(4, 1, {"w": torch.ones(2)}, {}))  # a held copy always comes with its CRC
    assert sorted(s.verified_inventory()) == [(0, 3), (0, 4)]
    assert s.corrupt_found == [(1, 4)]


# ---- the rollback plan ---------------------------------------------------------------


def test_the_newest_step_complete_for_every_rank_is_chosen() -> None:
    inv = {0: [(0, 4), (0, 5), (2, 4)], 1: [(1, 4), (1, 5), (0, 4), (0, 5)], 2: []}
    step, plan = plan_rollback(inv, 3, at_most=5)
    assert step == 4 and plan == [Fetch(holder=0, src=2)]


def test_ranks_holding_their_own_copy_need_no_fetch() -> None:
    inv = {r: [(r, 6), (r, 7), ((r + 1) % 3, 7)] for r in range(3)}
    assert plan_rollback(inv, 3, at_most=7) == (7, [])


def test_at_most_caps_the_rollback_step() -> None:
    inv = {r: [(r, 6), (r, 7), (r, 8)] for r in range(2)}
    assert plan_rollback(inv, 2, at_most=7) == (7, [])
    assert plan_rollback(inv, 2, at_most=100) == (8, [])
    with pytest.raises(NoSnapshot):
        plan_rollback(inv, 2, at_most=5)


def test_the_load_is_spread_over_the_holders() -> None:
    # ranks 0..3 are fresh spares; ranks 4 and 5 both hold a copy of each of them
    inv: dict[int, list[tuple[int, int]]] = {r: [] for r in range(4)}
    inv[4] = [(4, 3)] + [(r, 3) for r in range(4)]
    inv[5] = [(5, 3)] + [(r, 3) for r in range(4)]
    step, plan = plan_rollback(inv, 6, at_most=3)
    assert step == 3 and sorted(f.src for f in plan) == [0, 1, 2, 3]
    assert sorted(f.holder for f in plan) == [4, 4, 5, 5]


def test_no_holder_serves_two_ranks_while_another_that_could_idles() -> None:
    world, per_node, copies, lost = 6, 1, 3, {0, 2, 5}
    inv: dict[int, list[tuple[int, int]]] = {r: [] for r in range(world)}
    for r in range(world):
        for h in [r, *holders(r, world, per_node, copies)]:
            inv[h].append((r, 1))
    for r in lost:
        inv[r] = []
    step, plan = plan_rollback(inv, world, at_most=1)
    assert step == 1 and sorted(f.src for f in plan) == [0, 2, 5]
    served = [f.holder for f in plan]
    assert len(set(served)) == len(served), plan  # 0 <- 3, 2 <- 4, 5 <- 1 exists


def test_no_snapshot_names_the_ranks_with_no_copy_left() -> None:
    inv = {0: [(0, 4)], 1: [(1, 4)], 2: [], 3: []}
    with pytest.raises(NoSnapshot, match=r"no copy left of rank\(s\) \[2, 3\]"):
        plan_rollback(inv, 4, at_most=10)


def test_no_snapshot_lists_at_most_eight_lost_ranks() -> None:
    inv: dict[int, list[tuple[int, int]]] = {r: [] for r in range(12)}
    inv[0] = [(0, 1)]
    with pytest.raises(NoSnapshot) as e:
        plan_rollback(inv, 12, at_most=10)
    assert "[1, 2, 3, 4, 5, 6, 7, 8]..." in str(e.value)


def test_every_rank_computes_the_same_plan_whatever_the_inventory_order() -> None:
    a = {0: [(0, 2), (1, 2)], 1: [], 2: [(2, 2), (1, 2)]}
    b = {2: [(1, 2), (2, 2)], 0: [(1, 2), (0, 2)], 1: []}
    assert plan_rollback(a, 3, 2) == plan_rollback(b, 3, 2) == (2, [Fetch(holder=0, src=1)])


@st.composite
def placements(draw: st.DrawFn) -> tuple[int, int, int, int]:
    nodes = draw(st.integers(2, 6))
    per_node = draw(st.integers(1, 3))
    copies = draw(st.integers(1, nodes - 1))
    step = draw(st.integers(1, 50))
    return nodes, per_node, copies, step


def placed_inventory(nodes: int, per_node: int, copies: int, step: int) -> dict[int, list[tuple[int, int]]]:
    """Every rank's snapshot of `step` (and an older one) on itself and on its holders."""
    world = nodes * per_node
    inv: dict[int, list[tuple[int, int]]] = {r: [] for r in range(world)}
    for r in range(world):
        for h in [r, *holders(r, world, per_node, copies)]:
            inv[h] += [(r, step - 1), (r, step)]
    return inv


@settings(max_examples=150, deadline=None)
@given(placements(), st.data())
def test_losing_up_to_copies_whole_nodes_still_rolls_back_to_the_snapshot(
    p: tuple[int, int, int, int], data: st.DataObject
) -> None:
    nodes, per_node, copies, step = p
    world = nodes * per_node
    check_placement(world, per_node, copies)
    inv = placed_inventory(nodes, per_node, copies, step)
    lost_nodes = data.draw(st.sets(st.integers(0, nodes - 1), max_size=copies), label="lost nodes")
    lost = {n * per_node + i for n in lost_nodes for i in range(per_node)}
    for r in lost:
        inv[r] = []  # a fresh spare took the rank over: it holds nothing
    got, plan = plan_rollback(inv, world, at_most=step)
    assert got == step
    assert sorted(f.src for f in plan) == sorted(lost)  # each lost rank fetched once, the others use their own
    for f in plan:
        assert f.holder not in lost and f.holder != f.src
        assert (f.src, step) in inv[f.holder]


@settings(max_examples=60, deadline=None)
@given(placements(), st.data())
def test_losing_copies_plus_one_adjacent_nodes_loses_a_ranks_every_copy(
    p: tuple[int, int, int, int], data: st.DataObject
) -> None:
    nodes, per_node, copies, step = p
    world = nodes * per_node
    inv = placed_inventory(nodes, per_node, copies, step)
    first = data.draw(st.integers(0, nodes - 1), label="first lost node")
    lost_nodes = [(first + i) % nodes for i in range(copies + 1)]
    for n in lost_nodes:
        for i in range(per_node):
            inv[n * per_node + i] = []
    with pytest.raises(NoSnapshot) as e:
        plan_rollback(inv, world, at_most=step)
    # the first lost node's ranks had every copy on the lost nodes (with all nodes lost: every rank)
    gone = list(range(world)) if copies + 1 == nodes else [first * per_node + i for i in range(per_node)]
    assert str(gone[:8])[:-1] in str(e.value)


# ---- replicas' fingerprints (launcher/worker/redundancy/fingerprint.py) ---------------------------


def test_fingerprints_are_equal_for_equal_state_and_differ_for_one_nudged_value() -> None:
    from launcher.worker.redundancy.fingerprint import fingerprint

    a = {"model": {"w": torch.arange(6.0), "b": torch.zeros(2)}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}}
    b = {"model": {"w": torch.arange(6.0), "b": torch.zeros(2)}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}}
    assert fingerprint(a) == fingerprint(b)
    b["model"]["w"][0] += 1e-3
    assert fingerprint(a) != fingerprint(b)
    c = {"model": {"w": torch.arange(6.0).view(2, 3), "b": torch.zeros(2)}, "optim": a["optim"]}
    assert fingerprint(a) != fingerprint(c)  # same bytes, another shape


def test_the_majority_of_a_replica_group_names_the_odd_rank_and_two_replicas_cannot() -> None:
    from launcher.worker.redundancy.fingerprint import judge

    assert judge([7, 7, 7, 7], ((0, 1, 2, 3),)).clean
    v = judge([7, 9, 7, 5, 5, 5], ((0, 1, 2), (3, 4, 5)))
    assert v.odd == (1,) and not v.undecided
    v = judge([7, 9, 4, 4], ((0, 1), (2, 3)))
    assert v.odd == () and v.undecided == ((0, 1),)
    assert judge([1, 2], ((0,), (1,))).clean  # no replicas: nothing to compare


def test_a_tagged_copy_is_authentic_under_its_key_only_and_survives_the_header() -> None:
    key, other = bytes(range(32)), bytes(range(1, 33))
    f = Frozen.capture(9, 2, *nested_state()).seal(Mac(key))
    assert f.tag is not None and f.authentic(Mac(key)) and not f.authentic(Mac(other))
    assert f.authentic(None)  # a job without a data key checks nothing
    e = Frozen.empty_from([int(x) for x in f.header(Mac(key)).tolist()])
    e.payload.copy_(f.payload)
    assert e.authentic(Mac(key)) and (e.nonce, e.tag) == (f.nonce, f.tag)
    e.payload[5] ^= 0x01
    e.crc = checksum(e.payload)  # a forger can fix a CRC, not a tag
    assert e.verify() and not e.authentic(Mac(key))
    untagged = Frozen.empty_from([int(x) for x in Frozen.capture(9, 2, *nested_state()).header().tolist()])
    assert untagged.tag is None and not untagged.authentic(Mac(key))
    with pytest.raises(ValueError, match="describes no snapshot"):
        Frozen.empty_from([1, 0, -5, 0, 0, 10, 0, 0, 0, 0])
