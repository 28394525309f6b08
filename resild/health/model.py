"""Health data model shared by the NVML probe, the kmsg follower and the daemon."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any


class Verdict(str, enum.Enum):
    """Health of one GPU or of a whole node, ordered HEALTHY < DEGRADED < FAILED."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"  # usable, but should be fixed (drain when convenient)
    FAILED = "failed"  # must not run work: fence and replace the node

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Verdict.HEALTHY: 0, Verdict.DEGRADED: 1, Verdict.FAILED: 2}


def worst(*verdicts: Verdict) -> Verdict:
    """The most severe of the given verdicts (HEALTHY for none)."""
    return max(verdicts, key=_SEVERITY.__getitem__, default=Verdict.HEALTHY)


@dataclass
class RemapStatus:
    """Row remapping (Ampere+): nvmlDeviceGetRemappedRows."""

    corrected_rows: int
    uncorrected_rows: int
    pending: bool
    failure: bool


@dataclass
class GpuStatus:
    """One GPU as seen by the last poll (None = metric not read or not supported)."""

    index: int
    uuid: str | None = None
    verdict: Verdict = Verdict.HEALTHY
    reasons: list[str] = field(default_factory=list)
    last_xid: int | None = None
    last_xid_wall: float | None = None
    ecc_uncorrected: int | None = None
    remap: RemapStatus | None = None
    nvlink_down: list[int] = field(default_factory=list)
    throttle_reasons: list[str] = field(default_factory=list)
    temperature_c: int | None = None
    power_w: float | None = None
    recovery_action: int | None = None
    pcie_replays: int | None = None
    pcie_width: int | None = None  # lanes now / at most (GPU and slot)
    pcie_width_max: int | None = None
    pcie_gen: int | None = None  # link generation now / at most
    pcie_gen_max: int | None = None
    pci_bus_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _to_jsonable(self)
        return d


@dataclass
class HealthEvent:
    """A health change, emitted the moment it is seen.

    ``kind`` names the source, e.g. "xid", "ecc_dbe", "gpu_unavailable",
    "recovery_action", "gpu_lost", "probe_error", "probe_timeout",
    "ecc_uncorrected", "remap_failure", "remap_pending", "nvlink_down",
    "clock_event", "pcie_replay", "event_wait_error". ``gpu_index`` is None
    for node-level events. ``verdict`` is the GPU's verdict implied by this
    event alone; an Xid of class app_error implies HEALTHY (the GPU is fine,
    the ranks using it must restart), see ``xid_class``.
    """

    gpu_index: int | None
    kind: str
    code: int | None
    verdict: Verdict
    reason: str
    t_mono: float
    t_wall: float
    xid_class: str | None = None  # "app_error" | "degraded" | "failed" for Xid events
    action: str | None = None  # NVIDIA's recommended action, when known

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = _to_jsonable(self)
        return d


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): _to_jsonable(v) for k, v in obj.items()}
    return obj
