"""Slurm backend: one `srun --no-kill` step runs a node process on every node.

Slurm cannot kill one node's share of a step, so fencing is logical (the
controller answers every message of a fenced node with FENCE, and the node
process kills its workers when it hears it) plus a DRAIN in Slurm naming the
fault. Node death is detected by our heartbeats, never by waiting for
slurmctld (which takes ~12 s or more to mark a node down).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from resild import slurm
from resild.controller.backend import SlurmDrain
from resild.wire.keys import KeyDir, add_node_key

log = logging.getLogger("resild.slurm")


# Runs argv with the value after "--keys" (before "--") suffixed by /nodes/$SLURMD_NODENAME:
# one srun step runs the same command on every node, so the node picks its own directory.
_PICK_KEYS = (
    'p=; d=; for a do if [ -z "$d" ] && [ "$p" = --keys ]; then a="$a/nodes/$SLURMD_NODENAME"; '
    'elif [ "$a" = -- ]; then d=1; fi; set -- "$@" "$a"; shift; p=$a; done; exec "$@"'
)


def per_node_keys(node_cmd: list[str], nodes: list[str]) -> list[str]:
    """Give every node its own key pair (made now, before any node starts) and make each
    node process use only its own: the controller identifies nodes by key (ZAP User-Id)."""
    if "--keys" not in node_cmd:
        return list(node_cmd)
    i = node_cmd.index("--keys")
    if "--" in node_cmd and node_cmd.index("--") < i:
        return list(node_cmd)
    keys = KeyDir(Path(node_cmd[i + 1]))
    for n in nodes:
        add_node_key(keys, n)
    return ["/bin/sh", "-c", _PICK_KEYS, "sh", *node_cmd]


class SlurmBackend(SlurmDrain):
    def __init__(
        self,
        alloc: slurm.Allocation,
        nodes: list[str],
        node_cmd: list[str],
        env: Mapping[str, str] | None = None,
        drain_nodes: bool = True,
    ) -> None:
        super().__init__(env)
        self.alloc, self.nodes, self.node_cmd = alloc, nodes, node_cmd
        self.drain_nodes = drain_nodes
        self.proc: subprocess.Popen | None = None
        self.fenced: set[str] = set()
        self._srun_reported = False

    def start(self) -> None:
        argv = slurm.srun_node_launcher_cmd(self.alloc, self.nodes, per_node_keys(self.node_cmd, self.nodes))
        log.info("launching: %s", " ".join(argv))
        self.proc = subprocess.Popen(argv, env=self.env, start_new_session=True)

    def drain(self, node: str, reason: str) -> None:
        if self.drain_nodes:  # under standby controllers the leader drains (drain_nodes=False here)
            super().drain(node, reason)

    def fence(self, node: str, reason: str) -> None:
        self.fenced.add(node)

    def exited_nodes(self) -> list[tuple[str, int]]:
        """srun is one step for all nodes: if it ends while the job runs (a launch
        failure, or every node gone), every node not yet fenced has failed."""
        if self.proc is None or self.proc.poll() is None or self._srun_reported:
            return []
        self._srun_reported = True
        return [(n, self.proc.returncode) for n in self.nodes if n not in self.fenced]

    def shutdown(self, timeout_s: float) -> None:
        self.join_drains()
        if self.proc is None:
            return
        # srun waits for a dead node's task until slurmctld marks the node down
        # (~12 s or more): with a fenced node there is nothing worth waiting for.
        if self.fenced:
            timeout_s = min(timeout_s, 5.0)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.poll() is None:
            # srun forwards SIGINT/SIGTERM to the step's tasks; a fenced, frozen node may never
            # answer, so stop waiting on it after a bounded time.
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
