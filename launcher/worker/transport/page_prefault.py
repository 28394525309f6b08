"""Fault in a receiver's fresh host pages ahead of the bytes (Linux `MADV_POPULATE_WRITE`).

A spare's destination tensors are memory it never touched: every 4 KB page of a receive
traps into the kernel on its first write, inside gloo's receiving thread, one page at a
time. Populating the pages in bulk, in a helper thread running ahead of the receives in
their posting order, takes those faults off the wire's path (measured in
bench/replay_bandwidth.py). Populating changes no byte and maps nothing new: where it is
not supported (kernel < 5.14, not Linux) it is skipped.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable

import torch

_MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
_PAGE = 4096
_supported = sys.platform.startswith("linux")
_madvise: Callable[[int, int, int], int] | None = None


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    global _madvise, _supported
    if _madvise is None and _supported:
        try:
            f = ctypes.CDLL(None, use_errno=True).madvise
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            f.restype = ctypes.c_int
            _madvise = f
        except (OSError, AttributeError):
            _supported = False
    return _madvise


def populate(tensors: list[torch.Tensor]) -> int:
    """Populate each host tensor's pages, in order; returns the bytes advised."""
    global _supported
    madvise = _libc_madvise()
    done = 0
    if madvise is None:
        return done
    for t in tensors:
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" or n < _PAGE:
            continue
        a = t.data_ptr()
        lo, hi = a & ~(_PAGE - 1), (a + n + _PAGE - 1) & ~(_PAGE - 1)
        if madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: this kernel has no MADV_POPULATE_WRITE
                _supported = False
                return done
            continue  # e.g. a range glibc shares with a neighbour it unmapped meanwhile
        done += hi - lo
    return done


MIN_AHEAD_BYTES = 4 << 20  # below this a thread costs more than the faults it saves


def populate_ahead(tensors: list[torch.Tensor], min_bytes: int = MIN_AHEAD_BYTES) -> threading.Thread | None:
    """`populate` in a daemon thread (it holds the tensors until it is done), for a
    receive of at least `min_bytes`."""
    todo = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not _supported or sum(t.numel() * t.element_size() for t in todo) < min_bytes:
        return None
    th = threading.Thread(target=populate, args=(todo,), name="resild-prefault", daemon=True)
    th.start()
    return th
