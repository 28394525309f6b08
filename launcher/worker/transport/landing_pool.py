"""Host memory a waiting spare touched ahead of the state it will receive.

A spare's replay writes its parameters into the model it built (`state_transport`'s
in-place receive), but its optimizer has no state yet, so the moments (two thirds of an
AdamW shard's bytes) land in memory allocated during the replay: on a host every 4 KB
page of it faults on first write, while the job waits. The spare's warm-up
(`spare.warmup`) already steps the job's optimizer on stand-ins of the job's shard
shapes; it hands their optimizer state here instead of freeing it, and the replay takes
a tensor of the same dtype and shape from the pool for each large tensor it has no live
home for. What the pool holds is never state (its contents are whatever the warm-up's step
left, all overwritten): a tensor is taken once and becomes the received tensor's storage (a
cut-off replay drops it with the rest); a storage is kept once, so no two received tensors
can share one.

Host only (`add` keeps host tensors alone, `take` hands them out only for host memory):
on a GPU the caching allocator keeps the warm-up's freed blocks for the same sizes
already, and holding them here would only keep them from it.
"""

from __future__ import annotations

import threading

import torch

MIN_BYTES = 64 << 10  # as the transport's SMALL: smaller tensors travel batched, never alone


class LandingPool:
    """Touched host tensors by (dtype, shape); thread-safe (filled by the warm-up, drained
    by the replay, cleared once the spare holds its state)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = {}
        self._seen: set[int] = set()  # storages in the pool (an optimizer could list one tensor twice)
        self._lock = threading.Lock()
        self.nbytes = 0

    def add(self, t: torch.Tensor) -> bool:
        """Keep `t` (the caller lets go of it) if it is a host tensor of its own storage,
        contiguous and at least MIN_BYTES; -> whether it was kept."""
        n = t.numel() * t.element_size()
        if t.device.type != "cpu" or n < MIN_BYTES or not t.is_contiguous():
            return False
        if t.untyped_storage().nbytes() != n or t.storage_offset() != 0 or t.requires_grad:
            return False  # a view of something larger (it would keep all of it alive)
        with self._lock:
            if t.data_ptr() in self._seen:
                return False
            self._seen.add(t.data_ptr())
            self._free.setdefault((t.dtype, tuple(t.shape)), []).append(t)
            self.nbytes += n
        return True

    def take(self, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """A kept tensor of exactly this dtype and shape for memory on `device` (no longer
        the pool's), or None (always, for a device other than the host)."""
        if device.type != "cpu":
            return None
        with self._lock:
            free = self._free.get((dtype, tuple(shape)))
            if not free:
                return None
            t = free.pop()
            self._seen.discard(t.data_ptr())
            self.nbytes -= t.numel() * t.element_size()
            return t

    def clear(self) -> int:
        """Let go of everything left; -> the bytes let go."""
        with self._lock:
            n, self.nbytes = self.nbytes, 0
            self._free.clear()
            self._seen.clear()
        return n

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())


__all__ = ["MIN_BYTES", "LandingPool"]
