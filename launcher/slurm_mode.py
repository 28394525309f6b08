"""resil-run inside a Slurm allocation (sbatch or salloc)."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import click

from resild.faults import Fault, FaultSpecError, parse_fault

from . import slurm


def run_slurm(*, nodes: int | None, spares: int, nproc_per_node: int, inject: tuple[str, ...], events: Path | None,
              hang_timeout_s: float, heartbeat_timeout_s: float, run_dir: Path | None, as_json: bool,
              cmd: list[str], requeue_on_exhaustion: bool = False) -> int:
    try:
        alloc = slurm.allocation_from_env(os.environ)
    except slurm.SlurmEnvError as e:
        raise click.UsageError(f"cannot read the Slurm allocation: {e}") from None
    if alloc is None:
        raise click.UsageError("not inside a Slurm allocation (no SLURM_JOB_ID): run under sbatch/salloc, "
                               "or use --local for an embedded cluster on this machine")
    all_nodes = list(alloc.nodes)
    if nodes is not None:
        if nodes > len(all_nodes):
            raise click.UsageError(f"--nodes {nodes} but the allocation has {len(all_nodes)}: {alloc.nodelist}")
        all_nodes = all_nodes[:nodes]
    try:
        active, spare_nodes = slurm.split_roles(all_nodes, spares)
        faults = [parse_fault(s) for s in inject]
    except (ValueError, FaultSpecError) as e:
        raise click.UsageError(str(e)) from None
    for f in faults:
        if f.node not in all_nodes:
            raise click.UsageError(f"fault {f} names node {f.node!r}; nodes are {', '.join(all_nodes)}")

    from .job import JobSpec, run_job  # imports torch
    from .slurm_backend import SlurmBackend

    # The controller and store must be reachable from every node: bind on all
    # interfaces, advertise this host (override with RESILD_CONTROLLER_HOST).
    host = os.environ.get("RESILD_CONTROLLER_HOST") or socket.getfqdn()
    rd = run_dir or Path.cwd() / ".resild" / f"job-{alloc.job_id}"

    def make_backend(endpoint: str, keys_dir: Path, heartbeat_s: float) -> SlurmBackend:
        node_cmd = [sys.executable, "-m", "launcher.node", "--controller", endpoint, "--keys", str(keys_dir),
                    "--nproc", str(nproc_per_node), "--heartbeat-s", str(heartbeat_s), "--", *cmd]
        return SlurmBackend(alloc, all_nodes, node_cmd)

    spec = JobSpec(active=active, spares=spare_nodes, nproc_per_node=nproc_per_node, cmd=cmd, run_dir=rd,
                   faults=faults, events_path=events, hang_timeout_s=hang_timeout_s,
                   heartbeat_timeout_s=heartbeat_timeout_s, bind_host=host, bind_any=True)
    code, reason = run_job(spec, as_json=as_json, backend_factory=make_backend, return_reason=True)
    if code != 0 and requeue_on_exhaustion and reason.startswith("no spare left"):
        try:
            slurm.requeue(alloc.job_id, reason)  # requeue_cmd adds the "resild: " prefix
            print(f"resil-run: requeued job {alloc.job_id}: {reason}", file=sys.stderr)
        except slurm.SlurmError as e:
            print(f"resil-run: requeue failed: {e}", file=sys.stderr)
    return code
