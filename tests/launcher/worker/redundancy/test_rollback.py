"""Recovery by rollback (rollback.rollback) for real: forked processes in one gloo
group on 127.0.0.1 gather their verified inventories, plan, send the lost rank's
snapshot from its holder and verify it on arrival.

The processes come from a fork server that imported torch once (no second import
per rank) and never ran a parallel torch op: a child forked from the test process
itself can hang in its first OpenMP region when an earlier test used OpenMP
threads (seen in CI). Each reports a summary through a pipe and exits with
os._exit, and any left after the test is killed."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from launcher.worker.redundancy.rollback import gather_inventory, rollback
from launcher.worker.redundancy.snapshot_store import Frozen, NoSnapshot, SnapshotStore, _flip, holders
from launcher.worker.transport.mac import Mac
from tests.launcher.worker.redundancy.test_snapshot_store import bitwise_equal

pytestmark = pytest.mark.timeout(60)

Setup = Callable[[int], SnapshotStore]
Body = Callable[[int, Any], Any]


def state_of(rank: int, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    state = {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16()},
        "optim": {"state": {0: {"step": torch.tensor(float(step)), "m": torch.randn(64, 32, generator=g).double()}}},
        "mask": torch.rand(17, generator=g) > 0.5,
    }
    return state, {"rng": g.get_state(), "step": step}


def snap(rank: int, step: int) -> Frozen:
    return Frozen.capture(step, rank, *state_of(rank, step)).seal()


def _child(rank: int, world: int, port: int, body: Body, out: Any, closes: bool = False) -> None:  # pragma: no cover
    code = 1
    try:
        torch.set_num_threads(1)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1, whatever the host's name resolves to
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=20))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=20))
        result = body(rank, dist.distributed_c10d._get_default_group())
        out.send((rank, result, None))
        if not closes:  # a body that closes the group's connections leaves nothing to meet on
            dist.barrier()
            dist.destroy_process_group()
        code = 0
    except BaseException:
        out.send((rank, None, traceback.format_exc()))
    finally:
        out.close()
        os._exit(code)


def in_ranks(world: int, body: Body, closes: bool = False) -> dict[int, Any]:
    """Run `body(rank, pg)` in `world` forked processes over one gloo group; -> rank: result.
    `closes`: the body leaves the group's connections closed (no barrier after it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "launcher.worker.redundancy.rollback"])
    server = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    procs, pipes = [], []
    try:
        for r in range(world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(r, world, server.port, body, send, closes), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            pipes.append(recv)
        results: dict[int, Any] = {}
        errors = []
        for recv in pipes:
            assert recv.poll(30), "a rank sent nothing within 30 s"
            rank, result, error = recv.recv()
            results[rank] = result
            if error:
                errors.append(f"rank {rank}: {error}")
        assert not errors, "\n".join(errors)
        for p in procs:
            p.join(15)
        assert [p.exitcode for p in procs] == [0] * world
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for recv in pipes:
            recv.close()


def run_ranks(world: int, setup: Setup, at_most: int, attempts: int = 1) -> dict[int, dict[str, Any]]:
    """Every rank builds its store with `setup` and runs rollback(); -> what each rank saw."""
    return in_ranks(world, functools.partial(_rollback_body, setup, world, at_most, attempts))


def _rollback_body(
    setup: Setup, world: int, at_most: int, attempts: int, rank: int, pg: Any
) -> dict[str, Any]:  # pragma: no cover - forked child
    snaps = setup(rank)
    try:
        step, got, plan, damaged = rollback(pg, lambda w: w.wait(), snaps, rank, world, at_most, 8, attempts)
    except NoSnapshot as e:
        return {"no_snapshot": str(e)}
    return {
        "step": step,
        "got": None if got is None else (got.step, got.src),
        "thawed_ok": got is not None and got.verify() and bitwise_equal(got.thaw(), state_of(rank, step)),
        "plan": [(f.holder, f.src) for f in plan],
        "damaged": damaged,
        "corrupt_found": list(snaps.corrupt_found),
        "inventory": sorted(snaps.verified_inventory()),
    }


def spare_with_copies_elsewhere(rank: int) -> SnapshotStore:
    """3 ranks, one per node, 1 copy: rank 2 is a fresh spare; its snapshot of step 4
    survives on its holder (rank 0); ranks 0 and 1 have their own at 4 and 5."""
    s = SnapshotStore(rank)
    if rank == 2:
        return s
    for step in (4, 5):
        s.keep_own(snap(rank, step))
    if rank == holders(2, 3, 1, 1)[0]:
        s.keep_held(snap(2, 4))
    if rank == 1:
        s.keep_held(snap(0, 4))
        s.keep_held(snap(0, 5))
    return s


def test_a_spares_snapshot_is_fetched_from_its_holder_and_thaws_bitwise() -> None:
    res = run_ranks(3, spare_with_copies_elsewhere, at_most=5)
    assert {r["step"] for r in res.values()} == {4}  # rank 2's copy exists only at 4
    assert {tuple(map(tuple, r["plan"])) for r in res.values()} == {((0, 2),)}  # every rank made the same plan
    assert res[2]["got"] == (4, 2) and res[2]["thawed_ok"]
    assert res[0]["got"] is None and res[1]["got"] is None
    assert all(r["damaged"] == [] and r["corrupt_found"] == [] for r in res.values())
    assert (2, 4) in res[0]["inventory"]  # the holder still has it


def first_copy_damaged_in_memory(rank: int) -> SnapshotStore:
    """4 ranks, one per node, 2 copies: rank 3 is a fresh spare; its first holder's
    copy (rank 0) was damaged before the rollback, the second (rank 1) is good."""
    s = SnapshotStore(rank)
    if rank == 3:
        return s
    s.keep_own(snap(rank, 6))
    first, second = holders(3, 4, 1, 2)
    assert (first, second) == (0, 1)
    if rank in (first, second):
        c = snap(3, 6)
        if rank == first:
            _flip(c)
        s.keep_held(c)
    return s


KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


def _keyed_rollback(tagged_with: bytes | None, rank: int, pg: Any) -> dict[str, Any]:  # pragma: no cover - forked child
    """spare_with_copies_elsewhere, the spare's copy tagged with `tagged_with` (OTHER: not by
    a rank of this job, as a stranger on the wire would send it), every rank with KEY."""
    s = SnapshotStore(rank)
    if rank != 2:
        for step in (4, 5):
            s.keep_own(snap(rank, step))
    if rank == holders(2, 3, 1, 1)[0]:
        copy = Frozen.capture(4, 2, *state_of(2, 4))
        s.keep_held(copy.seal(Mac(tagged_with)) if tagged_with else copy.seal())
    try:
        step, got, _, damaged = rollback(pg, lambda w: w.wait(), s, rank, 3, 5, 8, 1, mac=Mac(KEY))
    except NoSnapshot as e:
        return {"no_snapshot": str(e)}
    return {"step": step, "ok": got is not None and bitwise_equal(got.thaw(), state_of(rank, step))}


@pytest.mark.parametrize(("tagged_with", "loaded"), [(KEY, True), (OTHER, False), (None, False)])
def test_a_fetched_copy_not_tagged_under_the_jobs_key_is_never_thawed(tagged_with: bytes | None, loaded: bool) -> None:
    res = in_ranks(3, functools.partial(_keyed_rollback, tagged_with))
    if loaded:
        assert res[2] == {"step": 4, "ok": True}
    else:
        assert all("no_snapshot" in r for r in res.values()), res  # struck, and no other copy of rank 2's


def test_a_copy_damaged_before_the_rollback_is_dropped_and_the_second_copy_is_used() -> None:
    res = run_ranks(4, first_copy_damaged_in_memory, at_most=6, attempts=3)
    assert res[0]["corrupt_found"] == [(3, 6)]
    assert all(r["plan"] == [(1, 3)] and r["step"] == 6 for r in res.values())
    assert res[3]["got"] == (6, 3) and res[3]["thawed_ok"]
    assert all(r["damaged"] == [] for r in res.values())  # caught by verification, never sent


class DamagesWhatItSends(SnapshotStore):
    """A holder whose memory flips a byte after it verified its inventory: the copy
    it sends no longer matches its checksum."""

    def get(self, src: int, step: int) -> Frozen | None:
        f = super().get(src, step)
        if f is None or src == self.rank:
            return f
        bad = Frozen(f.step, f.src, f.n_skel, f.n_askel, f.n_abuf, f.payload.clone(), f.crc)
        _flip(bad)
        return bad


def first_copy_damaged_in_transit(rank: int) -> SnapshotStore:
    s: SnapshotStore = DamagesWhatItSends(rank) if rank == 0 else SnapshotStore(rank)
    if rank == 3:
        return s
    s.keep_own(snap(rank, 6))
    if rank in holders(3, 4, 1, 2):
        s.keep_held(snap(3, 6))
    return s


def test_a_copy_that_arrives_damaged_is_struck_and_the_next_holder_sends_it() -> None:
    res = run_ranks(4, first_copy_damaged_in_transit, at_most=6, attempts=3)
    assert all(r["damaged"] == [(0, 3, 6)] and r["step"] == 6 for r in res.values())
    assert all(r["plan"] == [(1, 3)] for r in res.values())  # the plan made again, without the bad copy
    assert res[3]["got"] == (6, 3) and res[3]["thawed_ok"]
    assert (3, 6) not in res[0]["inventory"]  # the sender forgot its damaged copy


def test_with_one_attempt_a_copy_that_arrives_damaged_is_no_snapshot() -> None:
    res = run_ranks(4, first_copy_damaged_in_transit, at_most=6, attempts=1)
    assert all("arrived damaged" in r["no_snapshot"] for r in res.values())


MINE = {0: [(0, 3), (2, 5), (0, 0), (1, 4)], 1: [], 2: [(2, 7)]}


def _inventory(rank: int, pg: Any) -> dict[int, list[tuple[int, int]]]:  # pragma: no cover - forked child
    return gather_inventory(pg, lambda w: w.wait(), rank, 3, MINE[rank], 3)


def test_the_inventory_of_every_rank_is_gathered_newest_first_up_to_the_width() -> None:
    res = in_ranks(3, _inventory)
    assert res[0] == res[1] == res[2] == {0: [(2, 5), (1, 4), (0, 3)], 1: [], 2: [(2, 7)]}


# ---- replica replay carries checksums (state_transport.P2PTransport) -------------------


def _replay(damage: bool, rank: int, pg: Any) -> Any:  # pragma: no cover - forked child
    from launcher.worker.replica_map import Transfer
    from launcher.worker.transport import state_transport

    if damage and rank == 1:  # what arrives no longer matches what the sender summed
        real = state_transport.checksum
        state_transport.checksum = lambda t: real(t) ^ 1  # type: ignore[assignment]
    t = state_transport.P2PTransport(pg, torch.device("cpu"), lambda w: w.wait())
    got = t.exchange([Transfer(0, 1, 0, 2), Transfer(0, 1, 1, 2)], rank, lambda: state_of(0, 7))
    if got is None:
        return None
    return {"damaged": list(got.damaged), "equal": not got.damaged and bitwise_equal(got.state, state_of(0, 7)[0])}


def _replay_body(damage: bool) -> Body:
    return functools.partial(_replay, damage)


def test_a_replayed_transfer_is_verified_and_a_damaged_one_is_reported_not_loaded() -> None:
    ok = in_ranks(2, _replay_body(damage=False))
    assert ok[1] == {"damaged": [], "equal": True}
    bad = in_ranks(2, _replay_body(damage=True))
    assert bad[1] == {"damaged": [0], "equal": False}
