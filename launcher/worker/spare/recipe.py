"""What a waiting spare needs to know to warm up for this job's sharded state (pure).

A fresh process's first FSDP2 step is slow because DTensor's sharding propagation
runs its slow path once per op and argument layout (fake-tensor dispatch, strategy
expansion over the mesh): 0.1-0.3 s for an AdamW step and gradient clipping here,
10-30 step times. The propagation depends only on the mesh's shape, rank map,
dimension names and device type and on each tensor's global shape, stride, dtype
and placements, never on the rank; DTensor caches it under exactly those keys. So
rank 0 describes its optimizer's parameters and mesh once (`describe`, JSON, in
the job's store under `RECIPE_KEY`), and a spare waiting for ranks replays an
optimizer step and a clipping on stand-ins of the same layout
(`launcher.worker.spare.warmup`).

Only parameters on the mesh `job.mesh()` built, or on a slice of it (FSDP2 + tensor
parallelism: `mesh["shard"]` for the FSDP-only parameters, the whole mesh for the
TP-split ones), qualify (the spare cuts the same slices of its warm mesh, see
spare.warmup), and only optimizers of `torch.optim`; anything else gives no recipe,
and a spare simply does not warm up. The recipe is read from the
store, which any worker can write: it is parsed as JSON and validated, it never
names code to import beyond a `torch.optim` class, and a bad one only costs the
warm-up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from launcher.worker.torch_private import strided_shard_type, submesh_dims

RECIPE_KEY = "resild/spare-warmup/v2"
MAX_RECIPE_BYTES = 256 << 10  # the store takes values up to 512 KB
MAX_PARAMS = 20_000

# ("R", -1, 1) replicate, ("S", dim, 1) shard, ("T", dim, split) a strided shard (FSDP2's
# shard of a dimension tensor parallelism already split: torch's _StridedShard)
Placement = tuple[str, int, int]


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  # "float32"
    placements: tuple[Placement, ...]
    dims: tuple[int, ...] = ()  # the job mesh's dimensions the parameter lives on (): all of them

    def mesh_dims(self, ndim: int) -> tuple[int, ...]:
        return self.dims or tuple(range(ndim))

    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"recipe: {self.dtype!r} is not a torch dtype")
        return dt

    def local_shape(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shard a rank at coordinate 0 holds (torch.chunk's sizes, as FSDP2 and DTensor)."""
        out = list(self.shape)
        sizes = [mesh_shape[d] for d in self.mesh_dims(len(mesh_shape))]
        for (kind, dim, _), n in zip(self.placements, sizes):
            if kind in ("S", "T"):
                out[dim] = math.ceil(out[dim] / n) if out[dim] else 0
        return tuple(out)


@dataclass(frozen=True)
class Recipe:
    mesh_ranks: tuple[int, ...]  # the mesh's rank map, flattened row-major
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...]
    device_type: str
    optimizer: str  # a class name in torch.optim
    groups: tuple[tuple[dict[str, Any], tuple[int, ...]], ...]  # (hyperparameters, indices into params)
    params: tuple[ParamSpec, ...]

    @property
    def world_size(self) -> int:
        return max(self.mesh_ranks) + 1


def _placement(p: Any) -> Placement | None:
    from torch.distributed.tensor import Replicate, Shard

    if type(p) is Replicate:
        return ("R", -1, 1)
    if type(p) is Shard:
        return ("S", int(p.dim), 1)
    if type(p) is strided_shard_type():
        return ("T", int(p.dim), int(p.split_factor))
    return None  # Partial and others: not described


def _jsonable(v: Any) -> Any:
    """A hyperparameter as JSON (tuples as lists; a 1-element tensor as its number)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("non-finite hyperparameter")
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    raise ValueError(f"hyperparameter of type {type(v).__name__}")


def describe(optimizer: torch.optim.Optimizer, mesh: Any) -> str | None:
    """The recipe of `optimizer` over `mesh` (JSON), or None if a spare could not use one:
    an optimizer outside torch.optim, a parameter that is not a DTensor on `mesh` or a
    slice of it, a placement other than Replicate/Shard/strided Shard, a hyperparameter
    JSON cannot hold."""
    from torch.distributed.tensor import DTensor

    cls = type(optimizer)
    if (
        mesh is None
        or not cls.__module__.startswith("torch.optim")
        or getattr(torch.optim, cls.__name__, None) is not cls
    ):
        return None
    params: list[dict[str, Any]] = []
    groups: list[dict[str, Any]] = []
    try:
        for g in optimizer.param_groups:
            idx = []
            for p in g["params"]:
                dims = submesh_dims(p.device_mesh, mesh) if isinstance(p, DTensor) else None
                if dims is None:
                    return None
                pl = [_placement(x) for x in p.placements]
                if any(x is None for x in pl):
                    return None
                idx.append(len(params))
                params.append(
                    {
                        "shape": list(p.shape),
                        "stride": list(p.stride()),
                        "dtype": str(p.dtype).removeprefix("torch."),
                        "placements": pl,
                        "dims": list(dims),
                    }
                )
            hp = {k: _jsonable(v) for k, v in g.items() if k != "params"}
            groups.append({"hp": hp, "params": idx})
        text = json.dumps(
            {
                "mesh": {
                    "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
                    "shape": list(mesh.mesh.shape),
                    "names": list(mesh.mesh_dim_names or ()),
                    "device_type": str(mesh.device_type),
                },
                "optimizer": cls.__name__,
                "groups": groups,
                "params": params,
            }
        )
    except ValueError:
        return None
    if len(params) > MAX_PARAMS or len(text) > MAX_RECIPE_BYTES or not params:
        return None
    return text


def _ints(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"recipe: {what} must be a list of non-negative integers")
    return tuple(v)


def _placement_of(v: Any) -> Placement:
    """[kind, dim] or [kind, dim, split]."""
    if not isinstance(v, list) or len(v) not in (2, 3):
        raise ValueError("recipe: a placement is [kind, dim] or [kind, dim, split]")
    split = int(v[2]) if len(v) == 3 else 1
    if split < 1 or split > 1 << 20:
        raise ValueError("recipe: a strided shard's split factor is out of range")
    return (str(v[0]), int(v[1]), split)


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def parse(text: bytes | str) -> Recipe:
    """Validate a recipe read from the store; ValueError if it is not one."""
    if len(text) > MAX_RECIPE_BYTES:
        raise ValueError("recipe: too large")
    try:
        d = json.loads(text)
        m = d["mesh"]
        ranks, shape = _ints(m["ranks"], "mesh ranks"), _ints(m["shape"], "mesh shape")
        names = tuple(str(n) for n in m["names"])
        if not shape or math.prod(shape) != len(ranks) or sorted(ranks) != list(range(len(ranks))):
            raise ValueError("recipe: the mesh's ranks do not fill its shape")
        if len(names) != len(shape):
            raise ValueError("recipe: one name per mesh dimension")
        params = []
        for p in d["params"][:MAX_PARAMS]:
            pshape, stride = _ints(p["shape"], "shape"), _ints(p["stride"], "stride")
            dims = _ints(p.get("dims", list(range(len(shape)))), "dims")
            if not dims or len(set(dims)) != len(dims) or any(d >= len(shape) for d in dims):
                raise ValueError("recipe: a parameter's mesh dimensions are not the mesh's")
            pl = tuple(_placement_of(x) for x in p["placements"])
            if len(stride) != len(pshape) or len(pl) != len(dims):
                raise ValueError("recipe: a parameter's stride or placements do not fit")
            if any(k not in ("R", "S", "T") or (k != "R" and not 0 <= dim < len(pshape)) for k, dim, _ in pl):
                raise ValueError("recipe: unknown placement")
            spec = ParamSpec(pshape, stride, str(p["dtype"]), pl, () if dims == tuple(range(len(shape))) else dims)
            spec.torch_dtype()
            params.append(spec)
        groups = []
        for g in d["groups"]:
            idx = _ints(g["params"], "group params")
            if any(i >= len(params) for i in idx) or not isinstance(g["hp"], dict):
                raise ValueError("recipe: a group names a parameter it does not describe")
            groups.append(({str(k): _tuples(v) for k, v in g["hp"].items()}, idx))
        return Recipe(ranks, shape, names, str(m["device_type"]), str(d["optimizer"]), tuple(groups), tuple(params))
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"recipe: malformed ({e!r})") from None
