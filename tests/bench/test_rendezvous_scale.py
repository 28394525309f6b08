"""bench/rendezvous_scale.py, small: the schedule's request count, a two-node run against the
real controller (no TCPStore side: torch's import would dominate), and the fd-limit error."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bench.rendezvous_scale import lane_ops, lane_ranks, lanes_per_node

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "bench" / "rendezvous_scale.py")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))


def test_schedule_is_the_same_whatever_the_lanes() -> None:
    nodes, nproc = 3, 8
    for lpn in (1, 2, 8):
        ops = [
            op
            for n in range(nodes)
            for k in range(lpn)
            for op in lane_ops(5, "nccl+node", lane_ranks(n, k, nproc, lpn), nproc, nodes * nproc)
        ]
        # rank 0's unique id, one address per rank; every rank gets the id and its 7 peers
        assert len(ops) == 1 + nodes * nproc + nodes * nproc * nproc
        assert all(key.startswith("resild/e5/") for _, key, _ in ops)
    # gloo's batched reads: each rank's node group in one multi_get of all 8 keys (its own too)
    ops = lane_ops(5, "nccl+node+mget", lane_ranks(0, 0, nproc, 1), nproc, nodes * nproc)
    assert [op for op, _, _ in ops].count("multi_get") == nproc and len(ops) == 1 + nproc + nproc + nproc
    assert all(len(k.split("\n")) == nproc for op, k, _ in ops if op == "multi_get")
    world = lane_ops(1, "gloo_world+mget", [3], nproc, 300)  # 300 ranks: 3 batches of at most 128 keys
    assert [len(k.split("\n")) for op, k, _ in world if op == "multi_get"] == [128, 128, 44]
    assert lanes_per_node(250, 8, 2000) == 8 and lanes_per_node(1000, 8, 2000) == 2
    assert lanes_per_node(2000, 8, 2000) == 1


@pytest.mark.timeout(120)
def test_two_nodes_against_the_real_controller_directly_and_through_node_stores() -> None:
    p = subprocess.run(
        [sys.executable, SCRIPT, "--nodes", "2", "--repeats", "1", "--sides", "resild-node,resild", "--gets", "both"]
        + ["--json"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {(r["pattern"], r["side"]): r for r in map(json.loads, p.stdout.splitlines())}
    assert sorted(rows) == [
        (pat, side) for pat in ("nccl+node", "nccl+node+mget") for side in ("resild", "resild-node")
    ]
    # a get per peer: 1 id set + 16 address sets + 16 id gets + 16 x 7 peer gets; batched: 16 multi_gets
    for (pat, _), r in rows.items():
        n = 145 if pat == "nccl+node" else 49
        assert (r["nodes"], r["ranks"], r["requests"], r["errors"], r["unanswered"]) == (2, 16, n, 0, 0)
    assert rows[("nccl+node", "resild")]["server_requests"] == 145
    assert rows[("nccl+node+mget", "resild")]["server_requests"] == 49
    # through the node stores only the world id reaches the controller: its set, and a get per
    # node (two on rank 0's node when rank 0's own get comes after the others' was answered)
    assert all(3 <= rows[(pat, "resild-node")]["server_requests"] <= 4 for pat in ("nccl+node", "nccl+node+mget"))


def test_too_low_fd_limit_is_one_line() -> None:
    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    p = subprocess.run(
        [sys.executable, SCRIPT, "--nodes", "1000"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=low,
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and "ulimit -Hn" in p.stderr, p.stderr
