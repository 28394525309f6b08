"""Keeping DDP's gradient buckets identical on every rank across a recovery.

DDP re-buckets once, early in training, in the order gradients become ready
(rank 0's order, broadcast). A spare's fresh DDP would all-reduce in its initial
buckets while the survivors use the rebuilt ones: a collective mismatch, and
even with matching sizes a different summation order (not bitwise). After a
recovery every rank gets a fresh reducer whose *initial* buckets are the
survivors' rebuilt layout; the next re-bucketing then finds the same layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

Layout = list[list[int]]


def find_ddp(model: torch.nn.Module) -> DDP | None:
    return model if isinstance(model, DDP) else None


def bucket_layout(ddp: DDP) -> Layout | None:
    """The rebuilt bucket layout (parameter indices per bucket), once DDP has one."""
    d = ddp._get_ddp_logging_data()
    if not d.get("has_rebuilt_buckets") or not d.get("rebuilt_per_bucket_param_indices"):
        return None
    return [[int(x) for x in b.split()] for b in str(d["rebuilt_per_bucket_param_indices"]).split(",")]


@contextlib.contextmanager
def _assign(layout: Layout | None, cap_bytes: int) -> Iterator[None]:
    if layout is None:
        yield
        return
    orig = dist._compute_bucket_assignment_by_size

    def fixed(*_a: Any, **_k: Any) -> tuple[Layout, list[int]]:
        # DDP reverses what this returns ("approximate the order gradients are produced").
        return list(reversed(layout)), [cap_bytes] * len(layout)

    dist._compute_bucket_assignment_by_size = fixed  # type: ignore[assignment]
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = orig  # type: ignore[assignment]


def reset_reducer(ddp: DDP, layout: Layout | None) -> None:
    """A fresh reducer, as DDP's own __setstate__ builds one, bucketed as `layout`."""
    params, sparse = ddp._build_params_for_reducer()
    with _assign(layout, int(ddp.bucket_bytes_cap)):
        ddp._ddp_init_helper(params, sparse, ddp._build_debug_param_to_name_mapping(params), ddp.static_graph)
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
