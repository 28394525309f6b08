"""resild launcher: `resil-run` and the in-training runtime (`launcher.init`)."""
from __future__ import annotations

from .replicas import ReplicaMap
from .runtime import Job, ResilienceError, init

__all__ = ["init", "Job", "ReplicaMap", "ResilienceError"]
