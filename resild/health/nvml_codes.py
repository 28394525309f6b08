"""What NVML's numbers mean, for the probe (nvml_probe.py): return codes, event masks,
field ids, clock-event reasons and the thresholds resild applies to them, and the
decoders of the values NVML hands back. No NVML call is made here.
"""

from __future__ import annotations

import ctypes
from typing import Any

# nvmlReturn_t values (nvml.h), compared numerically so any binding works.
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
TIMEOUT = 10
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
LOST_CODES = {GPU_IS_LOST: "GPU is lost", RESET_REQUIRED: "GPU requires reset"}

EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_RECOVERY_ACTION = 0x8000
WATCHED_EVENTS = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION

FIELD_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
TEMPERATURE_GPU = 0
MEMORY_ERROR_UNCORRECTED = 1
VOLATILE_ECC = 0

CLOCK_EVENT_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Slowdowns caused by the hardware or its cooling. In synchronous training one
# slow GPU slows every rank, so these degrade the GPU; the others are normal.
DEGRADING_CLOCK_EVENTS = 0x8 | 0x20 | 0x40 | 0x80
GPU_IDLE = 0x1
# A clock-event read is one instant: a GPU degrades when slowdowns held at least
# CLOCK_EVENT_DUTY of its polls over CLOCK_EVENT_HOLD_S (a one-off brake is normal).
CLOCK_EVENT_HOLD_S = 30.0
CLOCK_EVENT_DUTY = 0.5

# DCGM's threshold: more than 8 PCIe replays a minute deserves a warning.
PCIE_REPLAY_WINDOW_S = 60.0
PCIE_REPLAY_MAX_PER_WINDOW = 8

# The same Xid on the same GPU within this window (e.g. from NVML and from
# kmsg) is reported once.
XID_DEDUP_WINDOW_S = 5.0


def handle_key(handle: Any) -> Any:
    """Identity of a device handle: its address for ctypes pointers (event data
    carries a new pointer object to the same device), else the object itself."""
    if handle is None:
        return None
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def field_value(v: Any) -> float | int:
    """The value of an nvmlFieldValue_t by its valueType."""
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(
        int(v.valueType), "ullVal"
    )
    value: float | int = getattr(v.value, attr)
    return value


def as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
