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
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from resild import slurm
from resild.controller.backend import SlurmDrain
from resild.procutil import stop_group
from resild.wire.keys import KeyDir, add_node_key

log = logging.getLogger("resild.slurm")


# Runs argv with the value after "--keys" (before "--") suffixed by /nodes/$SLURMD_NODENAME:
# one srun step runs the same command on every node, so the node picks its own directory.
_PICK_KEYS = (
    'p=; d=; for a do if [ -z "$d" ] && [ "$p" = --keys ]; then a="$a/nodes/$SLURMD_NODENAME"; '
    'elif [ "$a" = -- ]; then d=1; fi; set -- "$@" "$a"; shift; p=$a; done; exec "$@"'
)


def node_command_with(node_cmd: list[str], *flags: str) -> list[str]:
    """The node process's command line with `flags` added to its own (before "--")."""
    i = node_cmd.index("--") if "--" in node_cmd else len(node_cmd)
    return [*node_cmd[:i], *(f for f in flags if f not in node_cmd[:i]), *node_cmd[i:]]


def _stop(p: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for a step's srun, then stop it (SIGTERM is forwarded to its tasks), then kill it."""
    try:
        p.wait(timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(p, signal.SIGTERM, 10.0)


def per_node_keys(node_cmd: list[str], nodes: list[str], mint: bool = True) -> list[str]:
    """Give every node its own key pair (made now, before any node starts) and make each
    node process use only its own: the controller identifies nodes by key (ZAP User-Id).
    `mint=False`: the controller made them (nodes joining a running job)."""
    if "--keys" not in node_cmd:
        return list(node_cmd)
    i = node_cmd.index("--keys")
    if "--" in node_cmd and node_cmd.index("--") < i:
        return list(node_cmd)
    keys = KeyDir(Path(node_cmd[i + 1]))
    for n in nodes if mint else ():
        add_node_key(keys, n)
    return ["/bin/sh", "-c", _PICK_KEYS, "sh", *node_cmd]


class ColdSpares:
    """The cold-spare jobs this job asked the queue for (`resil-run --spare-target`): submitted
    and polled in a thread (sbatch and squeue take ~0.1 s: never on the controller's loop),
    every one still queued or running cancelled at the end."""

    POLL_S = 5.0

    def __init__(self, job_id: str, run_dir: Path, env: Mapping[str, str]) -> None:
        self.job_id, self.run_dir, self.env = job_id, run_dir, dict(env)
        self.submitted: list[str] = []
        self.open: frozenset[str] = frozenset()  # submitted and still in the queue (last poll)
        self.wanted = 0  # asked for, not yet submitted
        self.errors = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._fields: dict[str, str] | None = None
        self.joined: frozenset[str] = frozenset()  # sources ("slurm:<id>") of the jobs whose nodes joined

    def request(self, count: int) -> None:
        with self._lock:
            self.wanted += count
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cold-spares", daemon=True)
                self._thread.start()
        self._wake.set()

    def on_the_way(self, joined: frozenset[str]) -> int:
        with self._lock:
            self.joined = joined
            return self.wanted + sum(1 for j in self.open if f"slurm:{j}" not in joined)

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop:
            with self._lock:
                want = self.wanted
            if want:
                self._submit()
            if time.monotonic() >= next_poll:
                try:
                    alive = slurm.alive(list(self.submitted), env=self.env)
                    with self._lock:
                        self.open = frozenset(alive)
                except slurm.SlurmError as e:
                    log.error("cannot poll the cold-spare jobs: %s", e)
                next_poll = time.monotonic() + self.POLL_S
            self._wake.wait(1.0)
            self._wake.clear()

    def _submit(self) -> None:
        try:
            if self._fields is None:
                self._fields = slurm.job_fields(self.job_id, env=self.env)
            cmd = slurm.cold_spare_cmd(
                str(self.run_dir.resolve()), sys.executable, self._fields, str(self.run_dir.resolve() / "spare-%j.out")
            )
            jid = slurm.submit(cmd, env=self.env)
        except (slurm.SlurmError, ValueError) as e:
            self.errors += 1
            log.error("could not submit a cold spare: %s", e)
            time.sleep(min(60.0, 2.0**self.errors))  # the queue refused: do not hammer it
            return
        log.info("cold spare asked for: Slurm job %s", jid)
        with self._lock:
            self.wanted -= 1
            self.submitted.append(jid)
            self.open = self.open | {jid}

    def cancel_all(self, joined_too: bool) -> list[str]:
        """Cancel the cold-spare jobs still in the queue; their ids. Those whose nodes joined
        only with `joined_too`: they were told to shut down, and one may hold rank 0, saving."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(15.0)
        cancelled = []
        for jid in self.submitted:
            if not joined_too and f"slurm:{jid}" in self.joined:
                continue
            try:
                slurm.cancel(jid, only_running=False, env=self.env)
                cancelled.append(jid)
            except (slurm.SlurmError, ValueError) as e:
                log.error("could not cancel cold spare %s: %s", jid, e)
        return cancelled


class SlurmBackend(SlurmDrain):
    def __init__(
        self,
        alloc: slurm.Allocation,
        nodes: list[str],
        node_cmd: list[str],
        env: Mapping[str, str] | None = None,
        drain_nodes: bool = True,
        run_dir: Path | None = None,
    ) -> None:
        super().__init__(env)
        self.alloc, self.nodes, self.node_cmd = alloc, nodes, node_cmd
        self.drain_nodes = drain_nodes
        self.cold = ColdSpares(alloc.job_id, run_dir, self.env) if run_dir is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.fenced: set[str] = set()
        self._srun_reported = False
        # Nodes re-admitted (--readmit): each runs its node process in a step of its own.
        self.readmitted: dict[str, subprocess.Popen[bytes]] = {}
        self._readmit_reported: set[str] = set()

    def start(self) -> None:
        argv = slurm.srun_node_launcher_cmd(self.alloc, self.nodes, per_node_keys(self.node_cmd, self.nodes))
        log.info("launching: %s", " ".join(argv))
        self.proc = subprocess.Popen(argv, env=self.env, start_new_session=True)

    def drain(self, node: str, reason: str) -> None:
        if self.drain_nodes:  # under standby controllers the leader drains (drain_nodes=False here)
            super().drain(node, reason)

    def fence(self, node: str, reason: str) -> None:
        self.fenced.add(node)

    def restartable(self) -> frozenset[str]:
        """Fenced nodes of this allocation. Nothing here can see whether a fenced node's old
        node process is gone; the new one sweeps what is left of it first (--replace-stale),
        and the controller waits for the old incarnation's silence (readmission.py)."""
        return frozenset(n for n in self.fenced if n in self.alloc.nodes)

    def readmit(self, node: str) -> None:
        """The node back as a spare: a new step on it (`srun --overlap -w NODE`) whose node
        process kills what is left of the old one, qualifies, then registers with the key the
        controller just minted."""
        self.fenced.discard(node)
        self._readmit_reported.discard(node)
        cmd = node_command_with(self.node_cmd, "--qualify", "--replace-stale")
        argv = slurm.srun_node_launcher_cmd(self.alloc, [node], per_node_keys(cmd, [node], mint=False))
        log.warning("re-admitting %s: %s", node, " ".join(argv))
        self.readmitted[node] = subprocess.Popen(argv, env=self.env, start_new_session=True)

    def request_spares(self, count: int) -> None:
        if self.cold is not None:
            self.cold.request(count)

    def spares_on_the_way(self, joined: frozenset[str]) -> int:
        return self.cold.on_the_way(joined) if self.cold is not None else 0

    def exited_nodes(self) -> list[tuple[str, int]]:
        """srun is one step for all nodes: if it ends while the job runs (a launch
        failure, or every node gone), every node not yet fenced has failed."""
        out = []
        for node, p in self.readmitted.items():  # a re-admitted node's own step ended
            if p.poll() is not None and node not in self.fenced and node not in self._readmit_reported:
                self._readmit_reported.add(node)
                out.append((node, p.returncode))
        if self.proc is None or self.proc.poll() is None or self._srun_reported:
            return out
        self._srun_reported = True
        return out + [
            (n, self.proc.returncode) for n in self.nodes if n not in self.fenced and n not in self.readmitted
        ]

    def shutdown(self, timeout_s: float) -> None:
        if self.cold is not None and (cancelled := self.cold.cancel_all(joined_too=False)):
            log.warning("cancelled cold-spare jobs %s (never joined): the job is over", ", ".join(cancelled))
        try:
            self._shutdown(timeout_s)
        finally:
            if self.cold is not None:
                self.cold.cancel_all(joined_too=True)  # their nodes had our grace to finish

    def _shutdown(self, timeout_s: float) -> None:
        self.join_drains()
        for p in self.readmitted.values():
            _stop(p, min(timeout_s, 5.0) if self.fenced else timeout_s)
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
