"""Process helpers shared by every long-running resild process."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to signal us when our parent dies, so nothing is orphaned
    if resil-run or a node process is killed. Linux only; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except OSError:
        pass


def say(line: str) -> None:
    """One line on stderr in one write. A job's processes share one stderr pipe, which
    Python leaves unbuffered, and print() writes the text and its newline apart: two
    processes saying something at once ran their lines together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
