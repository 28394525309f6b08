"""What bench/gpu_check.py and its NCCL part (bench/gpu_nccl.py) share: the run's
budget, watchdog and result, child processes, and small formatting helpers."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"  # children re-run it in a hidden --role
REEXEC_MARK = "RESILD_GPU_CHECK_REEXEC"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"gpu_check [{time.monotonic() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def _tail(text: str, n: int = 2500) -> str:
    return text[-n:]


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


# ---- the run: budget, watchdog, one JSON line --------------------------------------------
class Run:
    def __init__(self, args: argparse.Namespace, json_fd: int) -> None:
        self.args, self.json_fd = args, json_fd
        self.deadline: float = T0 + args.budget_s
        self.result: dict[str, Any] = {}
        self.current: str | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._emitted = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def emit(self) -> None:
        with self._lock:
            if self._emitted:
                return
            self._emitted = True
            self.result["seconds"] = round(time.monotonic() - T0, 2)
            os.write(self.json_fd, (json.dumps(self.result, default=str) + "\n").encode())

    def watchdog(self) -> None:
        def fire() -> None:
            part = self.current
            if part is not None:
                self.result[part] = {
                    **(self.result.get(part) or {}),
                    "error": f"timed out: --budget-s {self.args.budget_s} ran out during this part",
                }
            for p in self.procs:
                _killpg(p)
            log(f"budget of {self.args.budget_s}s ran out in part {part}: printing what there is")
            self.emit()
            os._exit(0)

        t = threading.Timer(max(0.0, self.left()), fire)
        t.daemon = True
        t.start()

    def spawn(self, cmd: list[str], env: dict[str, str], timeout_s: float, stdout: Any = None) -> tuple[int, str, str]:
        """Run cmd in its own session (killed as a group on timeout); -> (rc, stdout, stderr)."""
        timeout_s = max(1.0, min(timeout_s, self.left() - 5.0))
        with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=True)
            self.procs.append(p)
            try:
                rc = p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _killpg(p)
                p.wait()
                rc = -9999
            finally:
                self.procs.remove(p)
            out.seek(0)
            err.seek(0)
            so, se = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if rc == -9999:
            se += f"\n[gpu_check: killed after {timeout_s:.0f}s]"
        return rc, so, se


def _killpg(p: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH", "")) if x)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---- part 1: the training loop, plain and under resild -------------------------------------
