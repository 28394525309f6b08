"""Training state as one flat byte buffer plus a JSON skeleton, so replay from a
replica is three transfers (header, skeleton, buffer) whatever the model is.

No pickle: the skeleton is JSON (dict keys keep their int/str type), tensors
travel as raw bytes in the buffer.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

_DTYPES = {
    str(d): d
    for d in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return {"__t": len(tensors) - 1, "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {"__d": [[_key(k), _skeleton(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__l" if isinstance(obj, list) else "__tu": [_skeleton(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot replay state of type {type(obj).__name__}; keep state to tensors and plain values")


def _key(k: Any) -> list[Any]:
    if isinstance(k, bool) or not isinstance(k, (int, str)):
        raise TypeError(f"state dict key {k!r} must be int or str")
    return ["i", k] if isinstance(k, int) else ["s", k]


def skeleton(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """-> (JSON skeleton, the tensors in buffer order): what flatten lays out, uncopied."""
    tensors: list[torch.Tensor] = []
    skel = _skeleton(state, tensors)
    return json.dumps(skel, separators=(",", ":")).encode(), tensors


def flatten(state: Any, device: torch.device | str | None = None) -> tuple[bytes, torch.Tensor]:
    """-> (JSON skeleton, one uint8 buffer holding every tensor's bytes back to back), on
    `device` (default: where the tensors are; a GPU job's state mixes CUDA parameters
    with CPU counters such as Adam's `step`, so name the device there)."""
    skel, tensors = skeleton(state)
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if device is not None:
        parts = [p.to(device) for p in parts]
    elif len({p.device for p in parts}) > 1:
        parts = [p.cpu() for p in parts]
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return skel, buf


def unflatten(skeleton: bytes, buf: torch.Tensor) -> Any:
    skel = json.loads(skeleton)
    offsets: list[int] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            if "__t" in node:
                n = torch.Size(node["shape"]).numel() * torch.empty(0, dtype=_DTYPES[node["dtype"]]).element_size()
                offsets.append(n)
                return
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(skel)
    starts = [0]
    for n in offsets:
        starts.append(starts[-1] + n)
    if starts[-1] != buf.numel():
        raise ValueError(f"state buffer holds {buf.numel()} bytes, skeleton describes {starts[-1]}")

    def build(node: Any) -> Any:
        if isinstance(node, dict):
            if "__t" in node:
                i = node["__t"]
                raw = buf[starts[i] : starts[i + 1]].clone()
                return raw.view(_DTYPES[node["dtype"]]).reshape(node["shape"])
            if "__d" in node:
                return {(k if kt == "s" else int(k)): build(v) for (kt, k), v in node["__d"]}
            if "__l" in node:
                return [build(v) for v in node["__l"]]
            if "__tu" in node:
                return tuple(build(v) for v in node["__tu"])
        return node

    return build(skel)


def checksum(t: torch.Tensor) -> int:
    """Of a uint8 buffer, where it lies: CRC-32 in host memory; on a GPU a position-weighted
    sum of its 64-bit words (integer sums wrap alike in any order, so it is exact), which
    needs no copy to the host."""
    if t.device.type == "cpu":
        return zlib.crc32(t.numpy().data) if t.numel() else 0
    n = t.numel()
    pad = (-n) % 8
    words = torch.cat([t, t.new_zeros(pad)]).view(torch.int64) if pad else t.view(torch.int64)
    idx = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64)
    return int((words.sum() + (words * idx).sum() + n).item()) & 0x7FFFFFFFFFFFFFFF
