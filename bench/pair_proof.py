"""What proving a gloo group's connections costs at formation (issue 39, finding 1).

``--ranks`` processes on this machine form one gloo group the way resild forms an epoch's
(``launcher.worker.torch_private.backend_group`` over a TCPStore on 127.0.0.1). On that
group each rank then runs ``launcher.worker.group_auth.prove_pairs``: a tag under a data key
sent to every peer and each peer's checked. That is ``--rounds`` proofs under new epochs,
with a barrier between them. Reported per group size: the formation's seconds (rank 0, the
baseline) and the proof's (median of the rounds, the slowest rank of each round), and the
ratio. The proof is 2(n-1) messages of 16 bytes a rank, all posted at once.

Usage::

    .venv/bin/python bench/pair_proof.py                     # 2, 4 and 8 ranks
    .venv/bin/python bench/pair_proof.py --ranks 2 4 --rounds 21 --json

Nothing here asserts on timings: it reports what it measured.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int, port: int, rounds: int, out: Any) -> None:  # pragma: no cover - child
    import torch

    from launcher.worker.group_auth import prove_pairs
    from launcher.worker.torch_private import PrefixStore, backend_group, tcp_store
    from launcher.worker.transport.mac import Mac

    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = PrefixStore("bench/e1/world/", tcp_store("127.0.0.1", port, timeout))
    t0 = time.perf_counter()
    pg = backend_group("gloo", store, rank, world, timeout, "127.0.0.1")
    formed = time.perf_counter() - t0
    mac = Mac(bytes(range(32)))
    proofs = []
    for epoch in range(2, rounds + 2):
        pg.allreduce([torch.zeros(1)]).wait()
        t = time.perf_counter()
        prove_pairs(pg, mac, epoch, "world", rank, world, 60.0)
        proofs.append(time.perf_counter() - t)
    pg.allreduce([torch.zeros(1)]).wait()
    out.put({"rank": rank, "formed_s": formed, "proofs_s": proofs})


def measure(world: int, rounds: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    master = TCPStore("127.0.0.1", 0, world + 1, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, master.port, rounds, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = [q.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    slowest = [max(r["proofs_s"][i] for r in reports) for i in range(rounds)]
    formed = next(r["formed_s"] for r in reports if r["rank"] == 0)
    proof = statistics.median(slowest)
    return {
        "ranks": world,
        "messages_per_rank": 2 * (world - 1),
        "formation_s": round(formed, 5),
        "proof_s": round(proof, 6),
        "proof_min_max_s": [round(min(slowest), 6), round(max(slowest), 6)],
        "proof_vs_formation": round(proof / formed, 4) if formed > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8], help="group sizes (processes on this machine)")
    p.add_argument("--rounds", type=int, default=11, help="proofs per group size (median of the slowest rank's)")
    p.add_argument("--json", action="store_true", help="one JSON object per group size")
    args = p.parse_args(argv)
    if min(args.ranks) < 2 or args.rounds < 1:
        p.error("--ranks must each be >= 2 and --rounds >= 1")
    if not args.json:
        print(f"{'ranks':>5} {'msgs/rank':>9} {'formation ms':>12} {'proof ms':>9} {'min-max ms':>15} {'ratio':>7}")
    for n in args.ranks:
        row = measure(n, args.rounds)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            lo, hi = row["proof_min_max_s"]
            print(
                f"{n:>5} {row['messages_per_rank']:>9} {row['formation_s'] * 1e3:>12.2f} {row['proof_s'] * 1e3:>9.3f}"
                f" {lo * 1e3:>7.3f}-{hi * 1e3:<7.3f} {row['proof_vs_formation']:>7.3f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
