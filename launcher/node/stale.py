"""What is left of a node's earlier incarnation in the same Slurm job: found and killed
before a re-admitted node process starts (`--replace-stale`).

Under Slurm a node fenced on suspicion is re-admitted with a new job step on the same
node (launcher/run/slurm_backend.py). Its old node process usually exited when it was
fenced, but a frozen one (a hang) never heard the fence, and its workers may still hold
the GPUs. The backend on the batch host cannot see the node's processes; the new node
process can, so it sweeps them first: node processes of this job on this node (by their
command line and Slurm environment) and everything they started.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

from launcher.node.command import MODULE

log = logging.getLogger("resild.node")

SWEEP_WAIT_S = 10.0  # a SIGKILLed process is gone within this, or the sweep says it is not


@dataclass(frozen=True)
class Seen:
    """One process as the sweep sees it."""

    pid: int
    cmdline: tuple[str, ...]
    environ: Mapping[str, str]


def stale_node_processes(procs: Iterable[Seen], me: int, job_id: str, node: str) -> list[int]:
    """Pids of the node processes of Slurm job `job_id` on `node` other than `me`. Pure."""
    out = []
    for p in procs:
        if p.pid == me or not job_id:
            continue
        runs_node = any(p.cmdline[i : i + 2] == ("-m", MODULE) for i in range(len(p.cmdline) - 1))
        if (
            runs_node
            and p.environ.get("SLURM_JOB_ID") == job_id
            and p.environ.get("SLURMD_NODENAME", p.environ.get("RESILD_NODE")) == node
        ):
            out.append(p.pid)
    return sorted(out)


def _seen() -> Iterable[Seen]:
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            yield Seen(p.pid, tuple(p.info["cmdline"] or ()), p.environ())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # not ours to read (another user) or gone


def sweep(node: str, env: Mapping[str, str] = os.environ) -> list[int]:
    """SIGKILL the stale node processes of this Slurm job on `node` and their descendants;
    -> the pids killed. Outside Slurm (no SLURM_JOB_ID) there is nothing to sweep."""
    job_id = env.get("SLURM_JOB_ID", "")
    stale = stale_node_processes(_seen(), os.getpid(), job_id, node)
    doomed: dict[int, psutil.Process] = {}
    for pid in stale:
        try:
            root = psutil.Process(pid)
            for q in [root, *root.children(recursive=True)]:
                doomed[q.pid] = q
        except psutil.NoSuchProcess:
            continue
    for q in doomed.values():
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(doomed.values()), timeout=SWEEP_WAIT_S)
    if alive:
        log.error("%s: stale processes still alive after SIGKILL: %s", node, [q.pid for q in alive])
    if doomed:
        log.warning("%s: killed what was left of its earlier node process: %s", node, sorted(doomed))
    return sorted(doomed)
