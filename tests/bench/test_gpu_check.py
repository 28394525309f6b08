"""bench/gpu_check.py without a GPU: exits 0 at once with one JSON line, every CUDA part
skipped and the state codec's flatten/unflatten exercised on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import _compare

REPO = Path(__file__).resolve().parents[2]
KEYS = ("torch", "cuda", "gpu", "loop", "snapshot_d2h", "replay_cuda", "nccl_group", "seconds")


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path (with CUDA it runs for minutes)")
def test_quick_without_cuda_prints_one_json_line() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert len(lines) == 1, p.stdout[-3000:]
    out = json.loads(lines[0])
    assert all(k in out for k in KEYS), sorted(out)
    assert out["cuda"] is False and out["gpu"] is None
    assert out["torch"] == torch.__version__
    for part in ("loop", "snapshot_d2h", "nccl_group"):
        assert out[part] == {"skipped": "no CUDA"}
    rep = out["replay_cuda"]
    assert "error" not in rep, rep
    assert rep["device"] == "cpu" and rep["buffer_device"] == "cpu"
    assert rep["as_is"] == "ok" and rep["equal"] is True and rep["mismatched"] == []
    assert rep["bytes"] > 1 << 20 and rep["tensors"] > 4
    assert rep["rollback_equal"] is True and rep["rollback_thaw_into_s"] > 0 and rep["rollback_thaw_s"] > 0
    assert rep["flatten_gbps"] > 0 and rep["unflatten_gbps"] > 0
    assert "replay_cuda: start" in p.stderr  # progress goes to stderr


def test_compare_is_bitwise() -> None:
    a = {"model": {"w": torch.tensor([1.0, -0.0])}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}, "n": 1}
    same = {"model": {"w": torch.tensor([1.0, -0.0])}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}, "n": 1}
    assert _compare(a, same) == (True, 2, [], [])
    signed = {"model": {"w": torch.tensor([1.0, 0.0])}, "optim": {"state": {0: {"step": torch.tensor(3.0)}}}, "n": 1}
    equal, _, bad, _ = _compare(a, signed)  # -0.0 == 0.0, but not bitwise
    assert not equal and bad == ["/model/w"]
    other = {"model": {"w": torch.tensor([1.0, -0.0])}, "optim": {"state": {"0": {"step": torch.tensor(3.0)}}}, "n": 1}
    assert _compare(a, other)[2] == ["/optim/state"]  # int key 0 vs str "0"
