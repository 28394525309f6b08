"""Xid codes -> health class, as data (overridable from config).

The table follows NVIDIA's Xid catalog and its recommended immediate action
(see shared/reference/gpu-health.md). Unknown codes are DEGRADED, not FAILED
and not ignored: an Xid we cannot interpret is worth a drain at the next
convenient point, but a new driver's informational Xid must not fence a whole
node. Config can move any code to another class (``{79: "failed"}``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from resild.health.model import Verdict


class HealthClass(str, enum.Enum):
    APP_ERROR = "app_error"  # the application faulted; the GPU is fine: restart its ranks
    DEGRADED = "degraded"  # keep running, fix at the next convenient point
    FAILED = "failed"  # the GPU (node) must be fenced and replaced

    @property
    def verdict(self) -> Verdict:
        """The GPU verdict this class implies (an app error leaves the GPU healthy)."""
        return {
            HealthClass.APP_ERROR: Verdict.HEALTHY,
            HealthClass.DEGRADED: Verdict.DEGRADED,
            HealthClass.FAILED: Verdict.FAILED,
        }[self]


_A, _D, _F = HealthClass.APP_ERROR, HealthClass.DEGRADED, HealthClass.FAILED

# code -> (class, NVIDIA's recommended immediate action, description)
XID_TABLE: dict[int, tuple[HealthClass, str, str]] = {
    13: (_A, "restart app", "graphics engine exception"),
    31: (_A, "restart app", "GPU memory page fault"),
    43: (_A, "ignore", "GPU stopped processing"),
    45: (_A, "follow the other Xid", "preemptive cleanup (follows other errors)"),
    46: (_F, "reset GPU", "GPU timeout"),
    48: (_F, "workflow (drain)", "double-bit ECC error"),
    62: (_F, "reset GPU", "internal micro-controller halt"),
    63: (_D, "ignore (reset later)", "row-remap event"),
    64: (_F, "reset GPU", "row-remap failure"),
    74: (_F, "workflow", "NVLink error"),
    79: (_F, "reboot node", "GPU has fallen off the bus"),
    92: (_D, "ignore", "high single-bit ECC error rate"),
    94: (_A, "restart app", "contained ECC error"),
    95: (_F, "reset GPU", "uncontained ECC error"),
    109: (_F, "reset GPU", "context-switch timeout"),
    119: (_F, "reset GPU", "GSP RPC timeout"),
    120: (_F, "reset GPU", "GSP error"),
    136: (_F, "reset GPU", "NVLink training failed"),
    140: (_F, "reset GPU", "unrecovered ECC error escape"),
    143: (_F, "reset GPU", "GPU initialization error"),
    144: (_D, "decode", "NVLink5 error (non-fatal)"),
    145: (_D, "decode", "NVLink5 error (non-fatal)"),
    146: (_D, "decode", "NVLink5 error (non-fatal)"),
    147: (_D, "decode", "NVLink5 error (non-fatal)"),
    148: (_D, "decode", "NVLink5 error (non-fatal)"),
    149: (_F, "reset GPU", "NVLink5 fatal error"),
    150: (_F, "reset GPU", "NVLink5 fatal error"),
    # 154's real class is the recovery action in field 230; the probe reads it.
    154: (_D, "read field 230 (GPU recovery action)", "GPU recovery action changed"),
    155: (_F, "reset GPU", "NVLink SW-defined error"),
    156: (_F, "reset GPU", "NVLink resource retirement"),
    158: (_F, "reset GPU", "NVLink fatal timeout"),
}

# Xid whose class depends on NVML field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION).
XID_RECOVERY_ACTION_CHANGED = 154


@dataclass(frozen=True)
class XidClass:
    code: int
    health_class: HealthClass
    action: str
    description: str
    known: bool  # False: not in the table, classified by the unknown-code rule
    overridden: bool  # True: class set by config, not by the table
    reason: str  # one line for logs, drain reasons and events

    @property
    def verdict(self) -> Verdict:
        return self.health_class.verdict


_CLASS_ALIASES = {
    "app_error": _A,
    "app": _A,
    "app-error": _A,
    "degraded": _D,
    "failed": _F,
    "fail": _F,
    "node_failed": _F,
}


def parse_health_class(value: str | HealthClass) -> HealthClass:
    """Accepts a HealthClass or its name ("app_error", "degraded", "failed")."""
    if isinstance(value, HealthClass):
        return value
    if isinstance(value, str) and value.strip().lower() in _CLASS_ALIASES:
        return _CLASS_ALIASES[value.strip().lower()]
    raise ValueError(f"invalid Xid class {value!r}: expected one of 'app_error', 'degraded', 'failed'")


# Config overrides of the Xid table: {79: "failed"} or, from TOML, {"79": "failed"}.
# (Mapping's key type is invariant: a union of the two mappings, not Mapping[int | str, ...].)
XidOverrides = Mapping[int, str | HealthClass] | Mapping[str, str | HealthClass]


def validate_overrides(overrides: XidOverrides | None) -> dict[int, HealthClass]:
    """Checks config overrides ({79: "failed"}); keys may be ints or numeric strings."""
    result: dict[int, HealthClass] = {}
    for key, value in (overrides or {}).items():
        try:
            code = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"invalid Xid override key {key!r}: expected an Xid number") from None
        if code < 0 or isinstance(key, bool):
            raise ValueError(f"invalid Xid override key {key!r}: expected an Xid number")
        try:
            result[code] = parse_health_class(value)
        except ValueError as e:
            raise ValueError(f"invalid Xid override for Xid {code}: {e}") from None
    return result


def classify_xid(code: int, overrides: XidOverrides | None = None) -> XidClass:
    """Class of one Xid: the table, then config overrides; unknown codes are DEGRADED."""
    checked = validate_overrides(overrides)
    row = XID_TABLE.get(code)
    if row is None:
        health_class, action, description = _D, "unknown", "unknown Xid"
    else:
        health_class, action, description = row
    overridden = code in checked
    if overridden:
        health_class = checked[code]
    reason = f"Xid {code} ({description}): {health_class.value}, NVIDIA action: {action}"
    if row is None:
        reason += "; not in the Xid table, degraded by default"
    if overridden:
        reason += " [class overridden by config]"
    return XidClass(
        code=code,
        health_class=health_class,
        action=action,
        description=description,
        known=row is not None,
        overridden=overridden,
        reason=reason,
    )


# Field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) value -> (class, meaning).
RECOVERY_ACTIONS: dict[int, tuple[HealthClass | None, str]] = {
    0: (None, "none"),
    1: (_F, "GPU reset required"),
    2: (_F, "node reboot required"),
    # P2P (NVLink) traffic must be drained: collectives over NVLink are unsafe.
    3: (_F, "drain P2P traffic and reset"),
    # Current work may finish; drain and reset when convenient.
    4: (_D, "drain and reset"),
    5: (_F, "recover IMEX domain"),
    6: (_F, "bus reset required"),
    7: (_F, "system reboot required"),
}


def classify_recovery_action(action: int) -> tuple[Verdict, str]:
    """GPU verdict and reason for a field-230 value; unknown values are DEGRADED."""
    health_class, meaning = RECOVERY_ACTIONS.get(action, (_D, f"unknown action {action}"))
    verdict = Verdict.HEALTHY if health_class is None else health_class.verdict
    return verdict, f"recovery action {action}: {meaning}"
