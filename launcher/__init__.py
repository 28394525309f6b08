"""resild launcher: `resil-run` and the in-training runtime (`launcher.init`).

The runtime (and so torch) is imported on first use, so batch-host tools such
as the Slurm helpers stay light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["init", "Job", "ReplicaMap", "ResilienceError"]


def __getattr__(name: str) -> Any:
    if name in ("init", "Job", "ResilienceError"):
        import launcher.worker.runtime as runtime

        return getattr(runtime, name)
    if name == "ReplicaMap":
        from launcher.worker.replica_map import ReplicaMap

        return ReplicaMap
    raise AttributeError(name)
