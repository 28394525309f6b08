"""What the controller can do to nodes besides talking to them. Local mode kills
process groups it started; Slurm mode drains nodes. I/O only, no decisions."""

from __future__ import annotations


class Backend:
    def fence(self, node: str, reason: str) -> None:
        """Make sure nothing of `node` runs any more (best effort, never raises)."""

    def drain(self, node: str, reason: str) -> None:
        """Take `node` out of the scheduler's pool with `reason`."""

    def exited_nodes(self) -> list[tuple[str, int]]:
        """Node processes that exited since the last call: (node, returncode)."""
        return []

    def shutdown(self, timeout_s: float) -> None:
        """At job end: wait for node processes, then kill what is left."""
