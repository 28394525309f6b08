"""What a rank must hold to continue training, and how to capture and restore it.

Two parts: the *replicated* state (model, optimizer, scheduler, grad scaler,
step), identical on every rank of a replica group, so a receiver may take
slices of it from several sources; and the *aux* state (RNG, `extra` such as a
data-loader cursor) as of the last commit, sent whole by one source.

Sharded (FSDP2/DTensor) tensors travel as their local shard: a spare receives
the shard it owns from the rank holding the same shard in another replica.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch

from launcher.worker.ddp import bucket_layout, find_ddp, reset_reducer
from launcher.worker.torch_private import scaler_found_inf, scaler_reset_stages, scaler_unscaled

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]


def to_local(obj: Any) -> Any:
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: to_local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_local(v) for v in obj)
    return obj


class TrainState:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        extra: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.extra = scaler, extra
        self.device = device or torch.device("cpu")
        self.generation = 0  # optimizer steps and restores applied: what a prepared replay checks

    # ---- aux: RNG and extra as of the last commit --------------------------------
    def capture_aux(self) -> dict[str, Any]:
        # deepcopy: a loader's state_dict may hand out live objects that keep moving.
        ddp = find_ddp(self.model)
        return {
            "extra": copy.deepcopy(self.extra.state_dict()) if self.extra is not None else None,
            "ddp_buckets": bucket_layout(ddp) if ddp is not None else None,
            "rng": torch.get_rng_state(),
            "py_rng": random.getstate(),
            "cuda_rng": torch.cuda.get_rng_state(self.device).cpu() if self.device.type == "cuda" else None,
        }

    def rewind_aux(self, a: dict[str, Any]) -> None:
        """An abandoned step consumed random numbers (dropout) and advanced the data
        loader; put both back to the commit, and drop the step's gradients."""
        if self.extra is not None and a["extra"] is not None:
            self.extra.load_state_dict(a["extra"])
        torch.set_rng_state(a["rng"])
        v, inner, gauss = a["py_rng"]
        random.setstate((v, tuple(inner), gauss))
        if a["cuda_rng"] is not None:
            torch.cuda.set_rng_state(a["cuda_rng"], self.device)
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_scaler_stage()

    def _reset_scaler_stage(self) -> None:
        # An abandoned step may have called scaler.unscale_(); GradScaler.update() resets
        # this same per-optimizer record, and the next step must start from it clean.
        if self.scaler is not None:
            scaler_reset_stages(self.scaler)

    def reset_hooks(self, layout: Any) -> None:
        """After a recovery: wrappers whose hooks keep per-rank communication state
        start again alike on every rank (DDP: a fresh reducer in the survivors' buckets)."""
        ddp = find_ddp(self.model)
        if ddp is not None:
            reset_reducer(ddp, layout)

    # ---- replicated state ---------------------------------------------------------
    def state_view(self, step: int) -> dict[str, Any]:
        """The replicated state at `step`: new dicts around the live tensors (uncopied)."""
        return {
            "step": step,
            "model": to_local(self.model.state_dict()),
            "optim": to_local(self.optimizer.state_dict()),
            "sched": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def restore(self, s: dict[str, Any], aux: dict[str, Any]) -> int:
        self.generation += 1
        live = self.model.state_dict()
        missing = set(live) ^ set(s["model"])
        if missing:
            raise ValueError(f"replayed model state does not match this model: keys {sorted(missing)[:5]} differ")
        with torch.no_grad():
            for k, v in live.items():
                dst, src = v.to_local() if isinstance(v, DTensor) else v, s["model"][k]
                if not _same_memory(dst, src):  # a replay may have written it in place
                    dst.copy_(src.to(dst.device))
        self.optimizer.load_state_dict(self._as_params(s["optim"]))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(s["sched"])
        if self.scaler is not None and s["scaler"] is not None:
            self.scaler.load_state_dict(s["scaler"])
        self.rewind_aux(aux)
        return int(s["step"])

    def _as_params(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Optimizer state of a sharded parameter is a DTensor laid out like the
        parameter: wrap each received local shard back the same way."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for idx, st in sd["state"].items():
            p = params[idx]
            if not isinstance(p, DTensor):
                continue
            local_shape = p.to_local().shape
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local_shape:
                    st[k] = DTensor.from_local(
                        v.to(p.device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
        return sd

    # ---- the optimizer step ---------------------------------------------------------
    def local_found_inf(self) -> int:
        """GradScaler: unscale (if the loop did not) and report whether this rank saw
        inf/NaN. With sharded gradients ranks differ, so the commit vote sums it."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 0
        if not scaler_unscaled(self.scaler, self.optimizer):
            self.scaler.unscale_(self.optimizer)
        return int(sum(v.item() for v in scaler_found_inf(self.scaler, self.optimizer)) > 0)

    def apply_step(self, found_inf: int) -> None:
        self.generation += 1
        if self.scaler is not None and self.scaler.is_enabled():
            if not scaler_unscaled(self.scaler, self.optimizer):
                self.scaler.unscale_(self.optimizer)
            for v in scaler_found_inf(self.scaler, self.optimizer):
                v.fill_(float(found_inf > 0))  # every rank skips, or none does
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr() != 0  # 0: no storage (meta), nothing is shared
        and a.dtype == b.dtype
        and a.shape == b.shape
    )
