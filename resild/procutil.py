"""Process helpers shared by every long-running resild process."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to signal us when our parent dies, so nothing is orphaned
    if resil-run or a node process is killed. Linux only; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def stop_group(p: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    """Signal the process group `p` leads (started with start_new_session), wait up to
    `timeout_s` for it, then SIGKILL the group and reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def say(line: str) -> None:
    """One line on stderr in one write. A job's processes share one stderr pipe, which
    Python leaves unbuffered, and print() writes the text and its newline apart: two
    processes saying something at once ran their lines together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
