"""resild probe: free space on local disks and /dev/shm.

A full /dev/shm breaks NCCL and data loaders; a full local disk breaks logs,
core dumps and caches. Each path has two thresholds on the free fraction
(and optionally free bytes): below ``degraded_*`` is DEGRADED, below
``failed_*`` is FAILED. A path that cannot be statted is FAILED (fail closed).
Config (``[probe_options.diskspace]``): ``paths`` (list; default ["/", "/tmp",
"/dev/shm"]), ``degraded_free_fraction`` (0.10), ``failed_free_fraction``
(0.02), ``degraded_free_bytes`` / ``failed_free_bytes`` (0 = off).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from resild.health.model import Verdict, worst
from resild.health.probes import ProbeResult

DEFAULT_PATHS = ("/", "/tmp", "/dev/shm")


@dataclass(frozen=True)
class Thresholds:
    degraded_free_fraction: float = 0.10
    failed_free_fraction: float = 0.02
    degraded_free_bytes: int = 0
    failed_free_bytes: int = 0


@dataclass(frozen=True)
class Usage:
    path: str
    total_bytes: int
    free_bytes: int  # available to unprivileged users (f_bavail)


def judge_usage(u: Usage, t: Thresholds) -> tuple[Verdict, str | None]:
    """Pure: one path's verdict and reason."""
    frac = u.free_bytes / u.total_bytes if u.total_bytes > 0 else 0.0
    what = f"{u.path}: {u.free_bytes / 2**30:.2f} GiB free ({frac:.1%})"
    if frac < t.failed_free_fraction or u.free_bytes < t.failed_free_bytes:
        return Verdict.FAILED, f"{what}, below the failed threshold"
    if frac < t.degraded_free_fraction or u.free_bytes < t.degraded_free_bytes:
        return Verdict.DEGRADED, f"{what}, below the degraded threshold"
    return Verdict.HEALTHY, None


def statvfs_usage(path: str) -> Usage:
    st = os.statvfs(path)
    return Usage(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


@dataclass
class DiskspaceProbe:
    paths: list[str] = field(default_factory=lambda: list(DEFAULT_PATHS))
    thresholds: Thresholds = field(default_factory=Thresholds)
    usage: Callable[[str], Usage] = statvfs_usage
    name: str = "diskspace"

    def check(self) -> ProbeResult:
        verdicts: list[Verdict] = []
        reasons: list[str] = []
        details: dict[str, Any] = {}
        for path in self.paths:
            try:
                u = self.usage(path)
            except OSError as e:
                verdicts.append(Verdict.FAILED)
                reasons.append(f"{path}: cannot stat: {e.strerror or e}")
                continue
            v, why = judge_usage(u, self.thresholds)
            verdicts.append(v)
            details[path] = {"total_bytes": u.total_bytes, "free_bytes": u.free_bytes}
            if why:
                reasons.append(why)
        return ProbeResult(worst(*verdicts), reasons, details)


def make_probe(options: Mapping[str, Any]) -> DiskspaceProbe:
    fields = {"degraded_free_fraction", "failed_free_fraction", "degraded_free_bytes", "failed_free_bytes"}
    unknown = set(options) - fields - {"paths"}
    if unknown:
        raise ValueError(f"unknown diskspace option(s): {', '.join(sorted(unknown))}")
    t = Thresholds(**{k: options[k] for k in fields if k in options})
    if not 0 <= t.failed_free_fraction <= t.degraded_free_fraction <= 1:
        raise ValueError("diskspace thresholds need 0 <= failed_free_fraction <= degraded_free_fraction <= 1")
    return DiskspaceProbe(list(options.get("paths", DEFAULT_PATHS)), t)
