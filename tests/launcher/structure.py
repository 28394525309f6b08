"""What a training script can reach, as plain data: two processes whose structures are
equal look the same to any loop, including one that keys on object identity.

Meshes are numbered in the order the walk first meets each object (so two equal but
distinct meshes get two numbers, as `id()` tells them apart); every parameter,
gradient and optimizer state tensor names its mesh by that number, with its placements,
shape, stride and dtype. Then the groups of each mesh (name and ranks), the default
group, and the process-wide settings a script reads: rank, world size, default dtype,
deterministic flags, grad mode and a digest of the RNG state.

Used by the spare's warm-up tests (a cold process vs a warmed one) and by the end-to-end
test of a loop keyed on identity (a recovered run vs a failure-free one, rank by rank).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist


def _tensor(t: Any, mesh_no: Any) -> dict[str, Any] | None:
    if t is None:
        return None
    out: dict[str, Any] = {"type": type(t).__name__, "shape": list(t.shape), "dtype": str(t.dtype)}
    mesh = getattr(t, "device_mesh", None)
    if mesh is not None:
        out["mesh"] = mesh_no(mesh)
        out["placements"] = [str(p) for p in t.placements]
        out["stride"] = list(t.stride())
    return out


def _group(pg: Any) -> dict[str, Any]:
    return {"name": pg.group_name, "ranks": dist.get_process_group_ranks(pg)}


def structure(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    meshes: list[dict[str, Any]] = []
    seen: dict[int, int] = {}
    kept: list[Any] = []  # alive while walking: ids stay unique

    def mesh_no(m: Any) -> int:
        if id(m) not in seen:
            seen[id(m)] = len(meshes)
            kept.append(m)
            meshes.append(
                {
                    "shape": list(m.mesh.shape),
                    "ranks": [int(r) for r in m.mesh.flatten().tolist()],
                    "names": list(m.mesh_dim_names or ()),
                    "device_type": m.device_type,
                    "groups": [_group(m.get_group(d)) for d in range(m.ndim)],
                    "coordinate": m.get_coordinate(),
                }
            )
        return seen[id(m)]

    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    out: dict[str, Any] = {
        "params": [_tensor(p, mesh_no) for p in params],
        "grads": [_tensor(p.grad, mesh_no) for p in params],
        # which of the model's parameters the optimizer holds (identity), and each one's state
        "opt_params": [[index.get(id(p)) for p in g["params"]] for g in opt.param_groups],
        "opt_state": [
            {
                k: _tensor(v, mesh_no) if isinstance(v, torch.Tensor) else repr(v)
                for k, v in sorted(opt.state[p].items())
            }
            for g in opt.param_groups
            for p in g["params"]
        ],
        "opt_hyper": [sorted(k for k in g if k != "params") for g in opt.param_groups],
    }
    out["meshes"] = meshes
    out["process"] = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "default_group": _group(dist.group.WORLD),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
        "grad_enabled": torch.is_grad_enabled(),
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16],
    }
    return out


def differences(a: dict[str, Any], b: dict[str, Any], path: str = "") -> list[str]:
    """Where two structures differ (paths), for an assertion message that says what."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += differences(a.get(k), b.get(k), f"{path}.{k}")
        return out
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]
