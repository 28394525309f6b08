"""Recovery by rollback, when no replica holds a lost rank's state.

  every rank verifies the copies it holds -> the group gathers the inventory ->
  all compute the same plan (newest step complete for every rank; plan_rollback)
  -> holders send the lost ranks' copies -> receivers verify the CRC -> a copy
  that fails is struck from the inventory and the plan is made again (the next
  copy) -> every rank restores that step (its own copy, or the one received).

Runs over the epoch's world group with the recovery's interruptible waits: a
newer epoch raises Reformed out of it like any other recovery step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from launcher.worker.redundancy.snapshot_exchange import FETCH_TAG, recv_frozen, send_frozen
from launcher.worker.redundancy.snapshot_store import (
    Fetch,
    Frozen,
    NoSnapshot,
    SnapshotStore,
    plan_rollback,
)
from launcher.worker.transport.mac import Mac


def gather_inventory(
    pg: Any, wait: Callable[[Any], None], rank: int, world: int, mine: list[tuple[int, int]], width: int
) -> dict[int, list[tuple[int, int]]]:
    """Every rank's verified (src, step) list, as one all-reduce of a W x width x 2 table."""
    table = torch.zeros(world, width, 2, dtype=torch.int64)
    for i, (src, step) in enumerate(sorted(mine, key=lambda x: -x[1])[:width]):
        table[rank, i, 0], table[rank, i, 1] = src + 1, step + 1  # 0 is "nothing here"
    wait(pg.allreduce([table]))
    out: dict[int, list[tuple[int, int]]] = {}
    for h, row in enumerate(table.tolist()):
        out[h] = [(s - 1, t - 1) for s, t in row if s > 0]
    return out


def rollback(
    pg: Any,
    wait: Callable[[Any], None],
    store: SnapshotStore,
    rank: int,
    world: int,
    at_most: int,
    width: int,
    attempts: int,
    mac: Mac | None = None,
) -> tuple[int, Frozen | None, list[Fetch], list[tuple[int, int, int]]]:
    """-> (the rollback step, the copy this rank received or None, the fetches made,
    (holder, src, step) of every copy that arrived damaged). Raises NoSnapshot."""
    inventory = gather_inventory(pg, wait, rank, world, store.verified_inventory(), width)
    damaged: list[tuple[int, int, int]] = []
    for _ in range(max(1, attempts)):
        step, plan = plan_rollback(inventory, world, at_most)
        got: Frozen | None = None
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        for f in plan:
            if f.holder == rank:
                copy = store.get(f.src, step)
                assert copy is not None, f"rank {rank} listed a copy of rank {f.src} step {step} it no longer has"
                w, h = send_frozen(pg, copy, f.src, FETCH_TAG)
                works += w
                keep.append(h)
        mine = [f for f in plan if f.src == rank]
        unreadable = False
        if mine:
            try:
                got = recv_frozen(pg, mine[0].holder, FETCH_TAG, wait)
            except ValueError:  # a header that describes no snapshot: not from a rank of this job
                unreadable = True
        for w in works:
            wait(w)
        bad = torch.zeros(world, dtype=torch.int64)
        if unreadable or (
            got is not None and (got.step != step or got.src != rank or not got.verify() or not got.authentic(mac))
        ):
            bad[rank] = mine[0].holder + 1
        wait(pg.allreduce([bad]))
        struck = [(int(h) - 1, src) for src, h in enumerate(bad.tolist()) if h > 0]
        if not struck:
            return step, got, plan, damaged
        for holder, src in struck:
            damaged.append((holder, src, step))
            inventory[holder] = [(s, t) for s, t in inventory[holder] if (s, t) != (src, step)]
            if holder == rank:
                store.forget(src, step)
    raise NoSnapshot(f"every copy tried of the rollback step arrived damaged: {damaged[:4]}")


def timed_thaw(f: Frozen) -> tuple[dict[str, Any], dict[str, Any], float]:
    t0 = time.monotonic()
    state, aux = f.thaw()
    return state, aux, time.monotonic() - t0
