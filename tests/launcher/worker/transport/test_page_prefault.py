"""A receiver's fresh pages are faulted in by `prefault` (MADV_POPULATE_WRITE), without
changing a byte; residency is read back with mincore(2)."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from launcher.worker.transport import page_prefault as prefault

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory advice"),
]

PAGE = 4096


def resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) pages of t's page-aligned interior."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    a = t.data_ptr()
    lo = (a + PAGE - 1) & ~(PAGE - 1)
    hi = (a + t.numel() * t.element_size()) & ~(PAGE - 1)
    n = (hi - lo) // PAGE
    vec = ctypes.create_string_buffer(n)
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw), n


def test_fresh_pages_become_resident_and_keep_their_bytes() -> None:
    t = torch.empty(64 << 20, dtype=torch.uint8)  # above glibc's largest mmap threshold: fresh pages
    before, n = resident_pages(t)
    assert before < n // 2  # not touched yet
    done = prefault.populate([t])
    if done == 0 and not prefault._supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    after, _ = resident_pages(t)
    assert after == n and done >= t.numel()
    assert int(t.count_nonzero()) == 0  # an anonymous page populated reads as zeros, like a fresh one


def test_the_helper_thread_populates_in_the_background_and_holds_the_tensors() -> None:
    ts = [torch.empty(40 << 20, dtype=torch.uint8) for _ in range(2)]
    th = prefault.populate_ahead(ts)
    if th is None:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    th.join(10)
    assert all(resident_pages(t)[0] == resident_pages(t)[1] for t in ts)


def test_nothing_to_do_is_nothing() -> None:
    assert prefault.populate_ahead([]) is None
    assert prefault.populate_ahead([torch.empty(1 << 20, dtype=torch.uint8)]) is None  # small: not worth a thread
    assert prefault.populate([torch.empty(16)]) == 0  # under a page
