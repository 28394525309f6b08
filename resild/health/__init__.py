"""GPU health layer of the node daemon: NVML probe, kernel-log Xid follower, Xid table.

Importing this package does not load NVML; ``NvmlProbe.start()`` does.
"""

from __future__ import annotations

from resild.health.kmsg import KmsgFollower, KmsgXid, parse_xid_line, pci_bus_key
from resild.health.model import GpuStatus, HealthEvent, RemapStatus, Verdict, worst
from resild.health.nvml_probe import NvmlProbe, NvmlUnavailable
from resild.health.verdict import node_verdict
from resild.health.xid import HealthClass, XidClass, classify_xid, validate_overrides

__all__ = [
    "GpuStatus",
    "HealthClass",
    "HealthEvent",
    "KmsgFollower",
    "KmsgXid",
    "NvmlProbe",
    "NvmlUnavailable",
    "RemapStatus",
    "Verdict",
    "XidClass",
    "classify_xid",
    "node_verdict",
    "parse_xid_line",
    "pci_bus_key",
    "validate_overrides",
    "worst",
]
