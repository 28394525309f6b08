"""The state codec: skeletons (format 2, format 1 still read), runs per dtype and shape
packed with few calls, and unpacking into a live state, a landing pool or new memory."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.worker.transport.codec import (
    ALIGN,
    assemble,
    encode,
    flatten,
    pack_plan,
    pack_runs,
    parse,
    run_view,
    skeleton,
    tensor_paths,
    unflatten,
    unpack_into,
)
from launcher.worker.transport.landing_pool import LandingPool
from tests.launcher.worker.redundancy.test_snapshot_store import bitwise_equal

pytestmark = pytest.mark.timeout(60)

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float64, torch.uint8)
SHAPES = ((), (0,), (1,), (3,), (17,), (2, 3), (4, 1, 5), (130, 129))  # the last: over 64 KB as float32


@st.composite
def states(draw: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    out: dict[str, Any] = {}
    for i in range(draw(st.integers(0, 30))):
        dtype, shape = draw(st.sampled_from(DTYPES)), draw(st.sampled_from(SHAPES))
        t = (torch.rand(shape, generator=g) * 100).to(dtype)
        out[f"t{i}"] = t.t() if t.dim() == 2 and draw(st.booleans()) else t  # some not contiguous
    return {"model": out, "optim": {0: {"step": torch.tensor(3.0)}}, "step": 7}


@settings(max_examples=60, deadline=None)
@given(states())
def test_packed_runs_hold_every_tensor_aligned_with_zeroed_gaps_and_unpack_bitwise(state: dict[str, Any]) -> None:
    skel, tensors, specs = encode(state)
    runs, n = pack_plan(specs)
    assert n == sum(r.nbytes for r in runs) and all(r.at % ALIGN == 0 and r.stride % ALIGN == 0 for r in runs)
    assert sorted(i for r in runs for i in r.indices) == [i for i, s in enumerate(specs) if s.nbytes]
    buf = torch.full((n,), 0xAB, dtype=torch.uint8)  # what a heap may hold
    pack_runs(tensors, runs, buf)
    for r in runs:
        rows = buf[r.at : r.at + r.nbytes].view(len(r.indices), r.stride)
        assert not rows[:, r.spec.nbytes :].any()
    back, written, landed = unpack_into(skel, buf, None)
    assert written == landed == 0 and bitwise_equal(back, state)
    packed = [t for t in skeleton(back)[1] if t.numel()]
    assert all(t.data_ptr() % ALIGN == 0 for t in packed)  # each as an allocation of its own would lie


def test_unpacking_writes_live_tensors_in_place_then_the_landing_pool_then_new_memory() -> None:
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(64, 300, generator=g), "m": torch.randn(64, 300, generator=g), "b": torch.randn(9)}
    skel, tensors, specs = encode(state)
    runs, n = pack_plan(specs)
    buf = torch.empty(n, dtype=torch.uint8)
    pack_runs(tensors, runs, buf)
    live_w = torch.zeros(300, 64).t()  # a live home that is not contiguous
    pool = LandingPool()
    warm = torch.zeros(64, 300)
    assert pool.add(warm)
    back, written, landed = unpack_into(skel, buf, {"w": live_w}, pool)
    assert back["w"] is not None and back["w"].data_ptr() == live_w.data_ptr() and torch.equal(live_w, state["w"])
    assert back["m"].data_ptr() == warm.data_ptr() and torch.equal(warm, state["m"])
    assert back["b"].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()  # free of the buffer
    assert (written, landed) == (64 * 300 * 4, 64 * 300 * 4) and torch.equal(back["b"], state["b"])
    with pytest.raises(ValueError, match="bytes"):
        unpack_into(skel, buf[:-ALIGN], None)


def test_a_parameter_that_requires_grad_packs_without_a_copy_of_its_own() -> None:
    p = torch.nn.Parameter(torch.randn(5, 3))
    skel, tensors, specs = encode({"p": p})
    runs, n = pack_plan(specs)
    buf = torch.empty(n, dtype=torch.uint8)
    pack_runs(tensors, runs, buf)
    assert torch.equal(run_view(buf, runs[0])[0], p.detach())


def test_keys_and_containers_keep_their_types_whatever_they_look_like() -> None:
    t = torch.arange(3.0)
    state = {
        "plain": {"a": t, "b": [1, (2.5, "x"), None]},
        "ours": {"__t": 0, "__d": [1], "__tu": "s"},  # keys a decoder reads as its own markers
        "ints": {5: t.clone(), "5": "str", 0: {"__l": True}},
        "tuple": (t, [t.clone()]),
    }
    skel, buf = flatten(state)
    back = unflatten(skel, buf)
    assert list(back["ours"]) == ["__t", "__d", "__tu"] and back["ours"]["__d"] == [1]
    assert list(back["ints"]) == [5, "5", 0] and back["ints"][0] == {"__l": True}
    assert type(back["tuple"]) is tuple and type(back["tuple"][1]) is list and back["plain"]["b"][1] == (2.5, "x")
    assert bitwise_equal(back, state)
    with pytest.raises(TypeError, match="key"):
        skeleton({True: t})


def test_a_format_1_skeleton_as_older_disk_checkpoints_hold_it_still_reads() -> None:
    v1 = (
        b'{"__d":[[["s","w"],{"__t":0,"dtype":"torch.bfloat16","shape":[2,1]}],'
        b'[["i",3],{"__l":[1,{"__tu":[2.5,"x"]},{"__t":1,"dtype":"torch.int64","shape":[]}]}]]}'
    )
    skel, specs = parse(v1)
    assert [(s.dtype, s.shape, s.nbytes) for s in specs] == [(torch.bfloat16, (2, 1), 4), (torch.int64, (), 8)]
    w, n = torch.ones(2, 1, dtype=torch.bfloat16), torch.tensor(7)
    assert bitwise_equal(assemble(skel, [w, n]), {"w": w, 3: [1, (2.5, "x"), n]})
    assert tensor_paths(skel) == [("w",), (3, ("#", 2))]
    with pytest.raises(ValueError, match="format 9"):
        parse(b'{"v":9,"s":null}')
    with pytest.raises(ValueError):
        parse(b'{"v":2,"g":[["torch.float32",[-1]]],"t":[0],"s":{"__t":0}}')


def test_what_a_skeleton_from_the_wire_cannot_do_is_refused_as_a_value_error() -> None:
    deep = b'{"v":2,"g":[],"t":[],"s":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    huge = b'{"v":2,"g":[["torch.float32",[99999999999999999999]]],"t":[0],"s":{"__t":0}}'
    v1_negative = b'{"__t":0,"dtype":"torch.float32","shape":[-2,-2]}'
    for bad in (deep, huge, v1_negative, b'{"v":2,"g":[["torch.quint8",[1]]],"t":[0],"s":{"__t":0}}'):
        with pytest.raises(ValueError):
            parse(bad)


def test_a_str_enum_key_travels_as_its_value_and_a_zero_size_tensor_keeps_its_live_home() -> None:
    import enum

    class Kind(str, enum.Enum):
        A = "a"

    back = unflatten(*flatten({Kind.A: torch.ones(2)}))
    assert list(back) == ["a"]
    live_empty = torch.zeros(0, 3)
    skel, tensors, specs = encode({"e": torch.zeros(0, 3), "w": torch.ones(4)})
    runs, n = pack_plan(specs)
    buf = torch.empty(n, dtype=torch.uint8)
    pack_runs(tensors, runs, buf)
    state, _, _ = unpack_into(skel, buf, {"e": live_empty})
    live_empty.zero_()  # bumps the version counter a detached alias shares, not a new tensor's
    assert state["e"]._version == live_empty._version == 1
