"""What resild's wrapper adds to one collective (issue 17, item 1), in microseconds.

N processes on loopback form one gloo group the way resild does
(`launcher.worker.torch_private.backend_group`) and wrap it in a `StableGroup`. Each
iteration issues the same collective twice, once on the backend group ("raw") and once
through the StableGroup ("resild"), alternating which goes first (ABBA), and waits on
each as FSDP2 and DDP do (`work.wait()`). Reported per collective: the median of each
side over the iterations (rank 0's clock) and the difference.

    python bench/collective_cost.py                      # 2 and 4 ranks, a table
    python bench/collective_cost.py --ranks 4 --iters 2000 --json
    python bench/collective_cost.py --ranks 1             # the wrapper's own cost: every collective trivial

Nothing here asserts on timings: it reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def _cases(world: int) -> list[tuple[str, Any]]:
    import torch
    import torch.distributed as dist

    one, t64 = torch.ones(1), torch.ones(16384)
    gather_out, rs_in, rs_out = torch.empty(16384 * world), torch.ones(16384 * world), torch.empty(16384)
    big = torch.ones(1 << 20)  # 4 MB
    return [
        ("all_reduce 4 B", lambda g: dist.all_reduce(one, group=g, async_op=True)),
        ("all_reduce 64 KB", lambda g: dist.all_reduce(t64, group=g, async_op=True)),
        ("all_reduce 4 MB", lambda g: dist.all_reduce(big, group=g, async_op=True)),
        (
            "all_gather_into_tensor 64 KB",
            lambda g: dist.all_gather_into_tensor(gather_out, t64, group=g, async_op=True),
        ),
        ("reduce_scatter_tensor 64 KB", lambda g: dist.reduce_scatter_tensor(rs_out, rs_in, group=g, async_op=True)),
    ]


def rank_main(rank: int, world: int, port: int, iters: int, q: Any) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    from launcher.worker.stable_group import Interrupts, StableGroup, register
    from launcher.worker.torch_private import backend_group, tcp_store

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    if rank == 0:
        store: Any = dist.TCPStore("127.0.0.1", port, world, True, timeout=timeout, wait_for_workers=False)
    else:
        store = tcp_store("127.0.0.1", port, timeout)
    inner = backend_group("gloo", dist.PrefixStore("bench/", store), rank, world, timeout, "127.0.0.1")
    stable = StableGroup("stable", list(range(world)), rank, Interrupts())
    stable.set_backend(inner)
    stable.allow = True
    register(stable, store)
    out: dict[str, Any] = {}
    for name, issue in _cases(world):
        for _ in range(max(20, iters // 20)):  # warm both paths
            issue(inner).wait()
            issue(stable).wait()
        a: list[float] = []
        b: list[float] = []
        for i in range(iters):
            order = (inner, stable) if i % 4 in (0, 3) else (stable, inner)  # ABBA
            for g in order:
                t0 = time.perf_counter()
                issue(g).wait()
                (a if g is inner else b).append(time.perf_counter() - t0)
        out[name] = {"raw_us": statistics.median(a) * 1e6, "resild_us": statistics.median(b) * 1e6}
    if rank == 0:
        q.put(out)


def measure(world: int, iters: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")  # torch is imported: never fork
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, iters, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        res: dict[str, Any] = q.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ranks", default="2,4", help="comma-separated world sizes (default 2,4; 1: the wrapper's own cost alone)"
    )
    p.add_argument("--iters", type=int, default=1000, help="iterations per collective (default 1000)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    try:
        worlds = [int(x) for x in a.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks must be comma-separated integers, not {a.ranks!r}")
    if not worlds or any(w < 1 for w in worlds) or a.iters < 1:
        p.error("--ranks needs world sizes >= 1 and --iters >= 1")
    load = os.getloadavg()[0]
    for w in worlds:
        res = measure(w, a.iters)
        for name, r in res.items():
            row = {"ranks": w, "collective": name, **{k: round(v, 1) for k, v in r.items()}}
            row["added_us"] = round(r["resild_us"] - r["raw_us"], 1)
            row["load"] = round(load, 2)
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{w} ranks  {name:30s} raw {r['raw_us']:8.1f} us   resild {r['resild_us']:8.1f} us"
                    f"   added {r['resild_us'] - r['raw_us']:+7.1f} us",
                    flush=True,
                )
    if not a.json:
        print(f"(load average at start {load:.2f}; medians over {a.iters} iterations per side, rank 0's clock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
