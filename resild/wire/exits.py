"""Exit codes resild's processes agree on (a backend, Slurm or a person reading `sacct` sees them)."""

from __future__ import annotations

FENCED_EXIT = 3  # a fenced node process or worker: the controller took its ranks away; it must never rejoin
CONTROLLER_LOST_EXIT = 75  # EX_TEMPFAIL: the node's lease on the controller ran out; the job may be requeued
