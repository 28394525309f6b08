"""Keeping DDP's gradient buckets identical on every rank across a recovery.

DDP re-buckets once, early in training, in the order gradients become ready
(rank 0's order, broadcast). A spare's fresh DDP would all-reduce in its initial
buckets while the survivors use the rebuilt ones: a collective mismatch, and
even with matching sizes a different summation order (not bitwise). After a
recovery every rank gets a fresh reducer whose *initial* buckets are the
survivors' rebuilt layout; the next re-bucketing then finds the same layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from launcher.worker.torch_private import ddp_bucket_cap_bytes, ddp_logging_data, ddp_reset_reducer

Layout = list[list[int]]


def find_ddp(model: torch.nn.Module) -> DDP | None:
    return model if isinstance(model, DDP) else None


def bucket_layout(ddp: DDP) -> Layout | None:
    """The rebuilt bucket layout (parameter indices per bucket), once DDP has one."""
    d = ddp_logging_data(ddp)
    if not d.get("has_rebuilt_buckets") or not d.get("rebuilt_per_bucket_param_indices"):
        return None
    return [[int(x) for x in b.split()] for b in str(d["rebuilt_per_bucket_param_indices"]).split(",")]


def reset_reducer(ddp: DDP, layout: Layout | None) -> None:
    """A fresh reducer, as DDP's own __setstate__ builds one, bucketed as `layout`."""
    if layout is None:
        ddp_reset_reducer(ddp, None)
        return
    cap_bytes = ddp_bucket_cap_bytes(ddp)

    def fixed(*_a: Any, **_k: Any) -> tuple[Layout, list[int]]:
        # DDP reverses what this returns ("approximate the order gradients are produced").
        return list(reversed(layout)), [cap_bytes] * len(layout)

    ddp_reset_reducer(ddp, fixed)
