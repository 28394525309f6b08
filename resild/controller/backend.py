"""What the controller can do to nodes besides talking to them. Local mode kills
process groups it started; Slurm mode drains nodes (SlurmDrain). I/O only, no decisions."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from resild import slurm

log = logging.getLogger("resild.slurm")


class Backend:
    def fence(self, node: str, reason: str) -> None:
        """Make sure nothing of `node` runs any more (best effort, never raises)."""

    def drain(self, node: str, reason: str) -> None:
        """Take `node` out of the scheduler's pool with `reason`."""

    def restartable(self) -> frozenset[str]:
        """Nodes whose node process is known to be gone and that `readmit` can start again."""
        return frozenset()

    def readmit(self, node: str) -> None:
        """Start a new node process on `node`, as a spare that qualifies first (`--qualify`)."""

    def request_spares(self, count: int) -> None:
        """Ask for `count` cold spares (they join on their own: `resil-run --join`)."""

    def spares_on_the_way(self, joined: frozenset[str]) -> int:
        """Cold spares asked for and not yet joined; `joined`: the sources of those that did."""
        return 0

    def exited_nodes(self) -> list[tuple[str, int]]:
        """Node processes that exited since the last call: (node, returncode)."""
        return []

    def shutdown(self, timeout_s: float) -> None:
        """At job end: wait for node processes, then kill what is left."""


class SlurmDrain(Backend):
    """Under Slurm fencing is logical (FENCE to the node process; Slurm cannot kill one
    node's share of a step) and a failed node is drained with the fault as its reason, in a
    thread: scontrol takes ~0.1 s, too long for the controller's loop. Used by the embedded
    controller's Slurm backend and by a standby leader on any node of the allocation."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env or os.environ)
        self.drained: dict[str, str] = {}
        self._threads: list[threading.Thread] = []

    def drain(self, node: str, reason: str) -> None:
        def run() -> None:
            try:
                slurm.drain(node, reason, env=self.env)
                self.drained[node] = reason
            except (slurm.SlurmError, OSError) as e:
                log.error("could not drain %s: %s", node, e)

        t = threading.Thread(target=run, name=f"drain-{node}", daemon=True)
        t.start()
        self._threads.append(t)

    def join_drains(self, timeout_s: float = 10.0) -> None:
        for t in self._threads:
            t.join(timeout_s)
