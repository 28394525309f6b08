"""A GPU rank's snapshot without stalling the training thread.

A plain copy of CUDA tensors to the host is synchronous and goes through pageable
memory (3.45 GB/s for 268 MB on an H200, bench/gpu_check.py; 55 GB/s into pinned
memory on a side stream, overlapping a matmul at 95%). So a GPU rank's snapshot is
staged into one of two reused pinned buffers on a side stream: the copy starts
after the optimizer step (the side stream waits on the training stream), runs
while the next step's forward and backward do (they only read the parameters),
and the next optimizer step waits for it (`before_write`): the snapshot never
tears. The exchange thread waits for the copy before it checksums and sends.
"""

from __future__ import annotations

from typing import Any

import torch

from launcher.worker.redundancy.snapshot_store import Frozen, Layout
from launcher.worker.transport.codec import run_view, zero_gaps


class DeviceStager:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch
        self._pool: list[torch.Tensor] = []  # pinned host buffers, reused
        self._done: Any = None  # the last copy's event: the next write to the live state waits on it

    def _buffer(self, n: int, busy: set[int]) -> torch.Tensor:
        """A pinned buffer of >= n bytes that no kept snapshot points into."""
        for b in self._pool:
            if b.numel() >= n and b.data_ptr() not in busy:
                return b
        b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self._pool = [x for x in self._pool if x.data_ptr() in busy] + [b]  # drop idle ones too small
        return b

    def capture(self, step: int, src: int, state: Any, aux: Any, busy: set[int]) -> Frozen:
        """`busy`: data_ptr()s of the buffers kept snapshots still use."""
        lay = Layout.of(state, aux)
        buf = self._buffer(lay.nbytes, busy)[: lay.nbytes]
        body = buf[lay.write_head(buf) :]
        zero_gaps(lay.runs, body)
        after_step = torch.cuda.Event()  # type: ignore[no-untyped-call]
        after_step.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), torch.no_grad():
            self.stream.wait_event(after_step)
            for r in lay.runs:  # each tensor into its slot of the host body: a device-to-host copy each
                for i, slot in zip(r.indices, run_view(body, r).unbind(0)):
                    x = lay.tensors[i]
                    slot.copy_(x, non_blocking=x.is_cuda)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
        for x in lay.tensors:  # the caching allocator must not reuse these before the copy read them
            if x.is_cuda:
                x.record_stream(self.stream)
        self._done = done
        return lay.frozen(step, src, buf, ready=done)

    def before_write(self) -> None:
        """The live state is about to change (optimizer step, restore): wait for the copy."""
        if self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None
