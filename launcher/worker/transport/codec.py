"""Training state as a JSON skeleton plus its tensors' bytes, whatever the model is.

`flatten`/`unflatten` lay the bytes back to back in one buffer (a disk checkpoint's aux);
`pack_plan`/`pack_runs`/`unpack_into` lay them a run per dtype and shape, so that a
state of hundreds of tensors is copied with a few calls (peer-memory snapshots);
replay sends the tensors themselves, small ones in such runs, and `assemble`s the
received ones (state_transport). No pickle: the skeleton is JSON (dict keys keep their
int/str type), tensors travel as raw bytes.
"""

from __future__ import annotations

import importlib
import json
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from launcher.worker.transport.landing_pool import LandingPool

# Every dtype with a fixed element size whose bytes can be viewed as uint8 (what this torch has).
_DTYPES: dict[str, torch.dtype] = {
    str(d): d
    for d in (
        getattr(torch, name, None)
        for name in (
            "float32",
            "float64",
            "float16",
            "bfloat16",
            "int64",
            "int32",
            "int16",
            "int8",
            "uint8",
            "bool",
            "uint16",
            "uint32",
            "uint64",
            "complex64",
            "complex128",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
        )
    )
    if isinstance(d, torch.dtype)
}
_NAMES = {d: name for name, d in _DTYPES.items()}
_ITEMSIZE = {d: torch.empty(0, dtype=d).element_size() for d in _DTYPES.values()}


_PLAIN = {type(None), bool, int, float, str}  # exact types, looked up before recursing (hot: one per state entry)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
FORMAT = 2  # of the skeleton; 1 (tensor specs inline, every key typed) is still read


class Spec(NamedTuple):
    """One tensor as the skeleton describes it; tensors of the same dtype and shape share
    one (the replay packs each such group with one call and unpacks it with one)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _spec(dtype: torch.dtype, shape: tuple[int, ...]) -> Spec:
    if dtype not in _NAMES:  # found when the state is taken, not when it is needed
        raise TypeError(f"cannot replay tensors of dtype {dtype}")
    return Spec(dtype, tuple(shape), math.prod(shape) * _ITEMSIZE[dtype])


class _Encoder:
    """One walk of a state: its structure as JSON (a tensor is {"__t": i}; a dict whose keys
    are all str and none starts with "__" is a JSON object, any other {"__d": [[key, value],
    ...]} with int or str keys; a tuple {"__tu": [...]}; a list an array), the tensors in
    walk order, and one Spec per tensor, shared by tensors of one dtype and shape. Per
    tensor only a type test and a dict lookup: a shard's state has hundreds of tensors."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.kinds: list[int] = []  # each tensor's index in `specs`
        self.specs: list[Spec] = []
        self._index: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}

    def node(self, obj: Any) -> Any:
        t = type(obj)
        if t in _TENSOR_TYPES or isinstance(obj, torch.Tensor):
            key = (obj.dtype, obj.shape)
            k = self._index.get(key)
            if k is None:
                k = self._index[key] = len(self.specs)
                self.specs.append(_spec(obj.dtype, obj.shape))
            self.kinds.append(k)
            self.tensors.append(obj)
            return {"__t": len(self.tensors) - 1}
        if isinstance(obj, dict):
            if all(type(k) is str and k[:2] != "__" for k in obj):
                return {k: v if type(v) in _PLAIN else self.node(v) for k, v in obj.items()}
            return {"__d": [[_key(k), v if type(v) in _PLAIN else self.node(v)] for k, v in obj.items()]}
        if isinstance(obj, list):
            return [v if type(v) in _PLAIN else self.node(v) for v in obj]
        if isinstance(obj, tuple):
            return {"__tu": [v if type(v) in _PLAIN else self.node(v) for v in obj]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot replay state of type {type(obj).__name__}; keep state to tensors and plain values")


def _key(k: Any) -> int | str:
    if isinstance(k, bool) or not isinstance(k, (int, str)):
        raise TypeError(f"state dict key {k!r} must be int or str")
    return int(k) if isinstance(k, int) else str.__str__(k)  # a str Enum's value, as JSON writes it


def encode(state: Any) -> tuple[bytes, list[torch.Tensor], list[Spec]]:
    """-> (JSON skeleton, the tensors in buffer order, uncopied, each one's Spec)."""
    enc = _Encoder()
    structure = enc.node(state)
    doc = {
        "v": FORMAT,
        "g": [[_NAMES[s.dtype], list(s.shape)] for s in enc.specs],
        "t": enc.kinds,
        "s": structure,
    }
    return json.dumps(doc, separators=(",", ":")).encode(), enc.tensors, [enc.specs[k] for k in enc.kinds]


def skeleton(state: Any) -> tuple[bytes, list[torch.Tensor]]:
    """-> (JSON skeleton, the tensors in buffer order): what flatten lays out, uncopied."""
    skel, tensors, _ = encode(state)
    return skel, tensors


# ---- packing many tensors with few calls ------------------------------------------------
ALIGN = 64  # each packed tensor's offset, as an allocation's: no kernel meets an offset it would not meet anyway


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Run(NamedTuple):
    """Tensors of one Spec at offset `at` of a buffer, one every `stride` bytes (their size
    rounded up to ALIGN), the gaps zeroed: packed with one stack, handed back as views by
    one unbind. A shard's state has few Specs (a parameter and its two moments share one),
    whatever its number of tensors: the per-tensor cost is torch's C++, not Python."""

    spec: Spec
    at: int
    indices: tuple[int, ...]

    @property
    def stride(self) -> int:
        return aligned(self.spec.nbytes)

    @property
    def nbytes(self) -> int:
        return self.stride * len(self.indices)


def run_view(buf: torch.Tensor, r: Run) -> torch.Tensor:
    """The run's tensors in `buf` (uint8, ALIGN-ed) as one view of shape (len, *shape)."""
    s = r.spec
    flat = buf[r.at : r.at + r.nbytes].view(s.dtype)
    inner = [1] * len(s.shape)
    for d in range(len(s.shape) - 1, 0, -1):
        inner[d - 1] = inner[d] * s.shape[d]
    return flat.as_strided((len(r.indices), *s.shape), (r.stride // _ITEMSIZE[s.dtype], *inner))


def pack_plan(specs: Sequence[Spec]) -> tuple[list[Run], int]:
    """Every tensor with bytes in one buffer: a run per Spec, in the order Specs first
    appear (alike wherever the Specs are known). -> (runs, the buffer's bytes)."""
    groups: dict[Spec, list[int]] = {}
    for i, s in enumerate(specs):
        if s.nbytes:
            groups.setdefault(s, []).append(i)
    runs, at = [], 0
    for s, indices in groups.items():
        runs.append(Run(s, at, tuple(indices)))
        at += runs[-1].nbytes
    return runs, at


_STACK_BELOW = 64 << 10  # tensors smaller than this are packed by stack (measured: bench/replay_bandwidth.py)


def pack_runs(tensors: Sequence[torch.Tensor], runs: Sequence[Run], buf: torch.Tensor) -> None:
    """Copy each run's tensors (from any device) into `buf`, the gaps zeroed (no heap bytes
    leave the rank): one stack per run of small tensors, a copy each for large ones."""
    with torch.no_grad():  # a parameter may require grad; out= refuses those
        for r in runs:
            if r.spec.nbytes < _STACK_BELOW:
                ts = [tensors[i] for i in r.indices]
                if any(t.device != buf.device for t in ts):  # e.g. Adam's CPU `step`s into a GPU batch
                    ts = [t.to(buf.device) for t in ts]
                torch.stack(ts, out=run_view(buf, r))
            else:  # few and large: a copy each (across devices too) is ~15% faster than stack into fresh pages
                for i, slot in zip(r.indices, run_view(buf, r).unbind(0)):
                    slot.copy_(tensors[i])
    zero_gaps(runs, buf)


def zero_gaps(runs: Sequence[Run], buf: torch.Tensor) -> None:
    """Zero the bytes between the runs' tensors in `buf` (one call per run that has any)."""
    for r in runs:
        if r.stride > r.spec.nbytes:
            buf[r.at : r.at + r.nbytes].view(len(r.indices), r.stride)[:, r.spec.nbytes :].zero_()


def unpack_into(skel: bytes, body: torch.Tensor, live: Any, landing: LandingPool | None = None) -> tuple[Any, int, int]:
    """The state `pack_plan`/`pack_runs` laid into `body` for the JSON skeleton `skel`. A
    tensor whose path in the live state `live` holds one of the same dtype and shape is
    copied into that live tensor (wherever it is: a GPU parameter, an optimizer's moment);
    one with no live home into one `landing` holds of its dtype and shape (host memory a
    spare touched while it waited), else into new memory (a run's whole bytes cloned at
    once). -> (the state, bytes written into live tensors, bytes written into `landing`'s)."""
    tree, specs = parse(skel)
    runs, n = pack_plan(specs)
    if n != body.numel():
        raise ValueError(f"state buffer holds {body.numel()} bytes, skeleton describes {n}")
    mine = live_matches(tree, specs, live)
    out: list[torch.Tensor | None] = [
        None if s.nbytes else mine.get(i, torch.empty(s.shape, dtype=s.dtype, device=body.device))
        for i, s in enumerate(specs)
    ]
    written = landed = 0
    with torch.no_grad():
        for r in runs:
            rest: list[tuple[int, torch.Tensor]] = []
            for i, v in zip(r.indices, run_view(body, r).unbind(0)):
                t = mine.get(i)
                if t is None and landing is not None:
                    t = landing.take(r.spec.dtype, r.spec.shape, body.device)
                    landed += r.spec.nbytes if t is not None else 0
                elif t is not None:
                    written += r.spec.nbytes
                if t is None:
                    rest.append((i, v))
                    continue
                t.copy_(v)
                out[i] = t
            if len(rest) == len(r.indices):  # none had a home: one clone, aligned as packed
                own = run_view(body[r.at : r.at + r.nbytes].clone(), Run(r.spec, 0, r.indices))
                for i, v in zip(r.indices, own.unbind(0)):
                    out[i] = v
            else:
                for i, v in rest:
                    out[i] = v.clone()
    if any(t is None for t in out):
        raise ValueError("packed state left tensors unfilled")
    return assemble(tree, [t for t in out if t is not None]), written, landed


def flatten(state: Any, device: torch.device | str | None = None) -> tuple[bytes, torch.Tensor]:
    """-> (JSON skeleton, one uint8 buffer holding every tensor's bytes back to back), on
    `device` (default: where the tensors are; a GPU job's state mixes CUDA parameters
    with CPU counters such as Adam's `step`, so name the device there)."""
    skel, tensors = skeleton(state)
    parts = [byte_view(t) for t in tensors]
    if device is not None:
        parts = [p.to(device) for p in parts]
    elif len({p.device for p in parts}) > 1:
        parts = [p.cpu() for p in parts]
    buf = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return skel, buf


def parse(skeleton: bytes) -> tuple[Any, list[Spec]]:
    """-> (the decoded skeleton, each tensor's Spec in buffer order), for `assemble`.
    Raises ValueError on anything that is not a skeleton."""
    try:
        doc = json.loads(skeleton)
        if type(doc) is not dict or "v" not in doc:
            return _parse_v1(skeleton)
        if doc["v"] != FORMAT:
            raise ValueError(f"skeleton format {doc['v']!r}: this resild reads {FORMAT} and 1")
        groups = [_checked_spec(name, dims) for name, dims in doc["g"]]
        if not all(type(k) is int and k >= 0 for k in doc["t"]):
            raise ValueError("bad tensor kinds")
        return doc["s"], [groups[k] for k in doc["t"]]
    except (KeyError, IndexError, TypeError, RecursionError) as e:
        raise ValueError(f"not a state skeleton: {e!r}") from None


MAX_TENSOR_BYTES = 1 << 44  # 16 TiB: no shard's tensor is larger; a skeleton that says so is not one


def _checked_spec(name: Any, dims: Any) -> Spec:
    if type(dims) is not list or not all(type(d) is int and d >= 0 for d in dims):
        raise ValueError(f"bad tensor shape {dims!r}")
    s = _spec(_DTYPES[name], tuple(dims))
    if s.nbytes > MAX_TENSOR_BYTES:
        raise ValueError(f"a tensor of {s.nbytes} bytes")
    return s


def _parse_v1(skeleton: bytes) -> tuple[Any, list[Spec]]:
    """Format 1 (what disk checkpoints older than format 2 hold), decoded into format 2's
    structure."""
    specs: dict[int, Spec] = {}

    def node(n: dict[str, Any]) -> Any:  # every JSON object is a node of ours, innermost first
        i = n.get("__t")
        if i is not None:
            specs[int(i)] = _checked_spec(n["dtype"], n["shape"])
            return {"__t": int(i)}
        if "__d" in n:
            return {"__d": [[k if kt == "s" else int(k), v] for (kt, k), v in n["__d"]]}
        if "__l" in n:
            return n["__l"]
        return n

    try:
        skel = json.loads(skeleton, object_hook=node)
    except (KeyError, IndexError, TypeError, RecursionError) as e:
        raise ValueError(f"not a state skeleton: {e!r}") from None
    if sorted(specs) != list(range(len(specs))):
        raise ValueError("skeleton's tensor indices are not 0..n-1")
    return skel, [specs[i] for i in range(len(specs))]


def assemble(skel: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The state a decoded skeleton describes, holding `tensors` themselves (no copy)."""
    n = len(tensors)

    def build(node: Any) -> Any:
        if type(node) is dict:
            if "__t" in node:
                i = node["__t"]
                if type(i) is not int or not 0 <= i < n:
                    raise ValueError(f"skeleton names tensor {i!r} of {n}")
                return tensors[i]
            if "__d" in node:
                return {k: v if type(v) in _PLAIN else build(v) for k, v in node["__d"]}
            if "__tu" in node:
                return tuple(v if type(v) in _PLAIN else build(v) for v in node["__tu"])
            return {k: v if type(v) in _PLAIN else build(v) for k, v in node.items()}
        if type(node) is list:
            return [v if type(v) in _PLAIN else build(v) for v in node]
        return node

    return build(skel)


def tensor_paths(skel: Any) -> list[tuple[Any, ...]]:
    """Each tensor's path in a decoded skeleton, in buffer order: dict keys as they are,
    list and tuple positions as ("#", i). `live_tensors` names a live state's alike."""
    out: dict[int, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if type(node) is dict:
            if "__t" in node:
                out[int(node["__t"])] = path
            elif "__d" in node:
                for k, v in node["__d"]:
                    walk(v, (*path, k))
            elif "__tu" in node:
                walk(node["__tu"], path)
            else:
                for k, v in node.items():
                    walk(v, (*path, k))
        elif type(node) is list:
            for i, v in enumerate(node):
                walk(v, (*path, ("#", i)))

    walk(skel, ())
    return [out[i] for i in range(len(out))]


def live_tensors(state: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of a live state by its path (as `tensor_paths` names them); none copied."""
    out: dict[tuple[Any, ...], torch.Tensor] = {}

    def walk(obj: Any, path: tuple[Any, ...]) -> None:
        if isinstance(obj, torch.Tensor):
            out[path] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if type(v) not in _PLAIN:
                    walk(v, (*path, k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                if type(v) not in _PLAIN:
                    walk(v, (*path, ("#", i)))

    walk(state, ())
    return out


def live_matches(skel: Any, specs: Sequence[Spec], live: Any) -> dict[int, torch.Tensor]:
    """Tensor index of a decoded skeleton -> the tensor of the live state `live` at the same
    path with the same dtype and shape (and storage: not on the meta device). Matched by
    path, never by position: an optimizer's state can list its parameters in another order."""
    mine = live_tensors(live) if live is not None else {}
    if not mine:
        return {}
    out: dict[int, torch.Tensor] = {}
    for i, (path, s) in enumerate(zip(tensor_paths(skel), specs)):
        t = mine.get(path)
        if t is not None and t.dtype == s.dtype and tuple(t.shape) == s.shape and t.device.type != "meta":
            out[i] = t.detach()
    return out


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor sharing its storage (a copy only if it is
    not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def typed_view(raw: torch.Tensor, spec: Spec) -> torch.Tensor:
    """`raw` (uint8, spec.nbytes long, aligned to the element size) seen as the tensor `spec` names."""
    return raw.view(spec.dtype).reshape(spec.shape)


def unflatten(skeleton: bytes, buf: torch.Tensor) -> Any:
    """Inverse of `flatten`; every tensor is a copy (free of `buf`, aligned as an allocation)."""
    skel, specs = parse(skeleton)
    n = sum(s.nbytes for s in specs)
    if n != buf.numel():
        raise ValueError(f"state buffer holds {buf.numel()} bytes, skeleton describes {n}")
    out, at = [], 0
    for s in specs:
        out.append(typed_view(buf[at : at + s.nbytes].clone(), s))
        at += s.nbytes
    return assemble(skel, out)


def _fastest_crc32() -> Callable[[Any], int]:
    """zlib-ng's CRC-32 where it is installed: the same function as zlib's (same values on
    every rank, whichever each has), carry-less multiply instead of tables, ~20 GB/s
    against ~2.5 here, so that checksumming a replay costs a fraction of its wire time.
    Both release the GIL on large buffers."""
    try:
        fast: Callable[[Any], int] = importlib.import_module("zlib_ng.zlib_ng").crc32
    except ImportError:
        return zlib.crc32
    return fast if fast(b"123456789") == zlib.crc32(b"123456789") == 0xCBF43926 else zlib.crc32


_crc32 = _fastest_crc32()


def checksum(t: torch.Tensor) -> int:
    """Of a uint8 buffer, where it lies: CRC-32 in host memory; on a GPU a position-weighted
    sum of its 64-bit words (integer sums wrap alike in any order, so it is exact), which
    needs no copy to the host."""
    if t.device.type == "cpu":
        return _crc32(t.numpy().data) if t.numel() else 0
    n = t.numel()
    pad = (-n) % 8
    aligned = not pad and t.storage_offset() % 8 == 0  # a slice may start anywhere: then copied
    words = t.view(torch.int64) if aligned else torch.cat([t, t.new_zeros(pad)]).view(torch.int64)
    idx = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64)
    return int((words.sum() + (words * idx).sum() + n).item()) & 0x7FFFFFFFFFFFFFFF
