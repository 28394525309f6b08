"""resil-run inside a Slurm allocation (sbatch or salloc)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import click

import resild.wire.env as resild_env
from launcher.node.command import node_command
from resild import slurm
from resild.controller.faults import FaultSpecError, parse_fault
from resild.procutil import say
from resild.wire.settings import JobSettings

if TYPE_CHECKING:
    from resild.controller.etcd_target import EtcdTarget

# ---- will Slurm cancel the allocation when a node fails? -----------------------------------------
# Without `sbatch --no-kill` Slurm revokes the whole allocation when one of its nodes fails, and
# no spare can help. A job cannot ask Slurm directly in 22.05: `sbatch --no-kill` sets no
# environment variable and `scontrol show job` does not print it. What a job can read: the
# JSON job record of newer Slurm (kill_on_node_fail), the submit line (SubmitLine=, 23.02+),
# its own batch script's #SBATCH directives, and SBATCH_NO_KILL when the user set it.
NO_KILL_MESSAGE = (
    "resil-run: WARNING: job {job} was not submitted with --no-kill: when a node fails Slurm "
    "cancels the whole allocation, spares included, and resild cannot recover. "
    "Add `#SBATCH --no-kill` (or `sbatch -k`)."
)
NO_KILL_UNKNOWN = (
    "resil-run: note: could not tell whether job {job} has --no-kill ({why}). Without it a node "
    "failure cancels the whole allocation, spares included: submit with `#SBATCH --no-kill`."
)
_SBATCH_DIRECTIVE = re.compile(r"^#SBATCH\s+(.*)$")


def _no_kill_in_args(args: list[str]) -> bool | None:
    """True/False if these sbatch arguments say --no-kill / --no-kill=off; None if silent."""
    said: bool | None = None
    for a in args:
        if a in ("-k", "--no-kill") or a == "--no-kill=on":
            said = True
        elif a == "--no-kill=off":
            said = False
    return said


def no_kill_from_script(script: str) -> bool | None:
    """sbatch reads #SBATCH lines only until the first command line."""
    said: bool | None = None
    for line in script.splitlines()[1:] if script.startswith("#!") else script.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        m = _SBATCH_DIRECTIVE.match(stripped)
        if m:
            try:
                got = _no_kill_in_args(shlex.split(m.group(1), comments=True))
            except ValueError:
                continue
            said = got if got is not None else said
        elif not stripped.startswith("#"):
            break
    return said


def no_kill_from_job_json(text: str) -> bool | None:
    try:
        jobs = json.loads(text).get("jobs") or []
    except (ValueError, AttributeError):
        return None
    if jobs and isinstance(jobs[0], dict) and "kill_on_node_fail" in jobs[0]:
        return not bool(jobs[0]["kill_on_node_fail"])
    return None


def no_kill_from_show_job(text: str) -> bool | None:
    m = re.search(r"\bSubmitLine=(.*)$", text, flags=re.M)
    if not m:
        return None
    try:
        args = shlex.split(m.group(1))
    except ValueError:
        return None
    return _no_kill_in_args(args)  # silent: it may still be in the script's directives


def allocation_survives_node_failure(
    job_id: str, env: Mapping[str, str], run: Callable[[list[str]], str | None]
) -> tuple[bool | None, str]:
    """(True: --no-kill, False: a node failure cancels the job, None: cannot tell; how we know).

    `run(argv)` returns a command's stdout or None when it failed. Command-line flags win over
    script directives, which win over SBATCH_NO_KILL (sbatch's own order of precedence).
    Checked on Slurm 22.05: no JSON, no SubmitLine, and `sbatch -k` on the command line leaves
    no trace a job can read, so a script without the directive is "cannot tell", not "no".
    """
    got = no_kill_from_job_json(run(["scontrol", "show", "job", "--json", job_id]) or "")
    if got is not None:
        return got, "scontrol show job --json"
    show = run(["scontrol", "show", "job", job_id]) or ""
    got = no_kill_from_show_job(show)
    if got is not None:
        return got, "the submit line"
    script = run(["scontrol", "write", "batch_script", job_id, "-"])
    got = no_kill_from_script(script) if script else None
    if got is not None:
        return got, "#SBATCH directives"
    if "SBATCH_NO_KILL" in env:
        return env["SBATCH_NO_KILL"].lower() not in ("off", "0", "no", "false"), "SBATCH_NO_KILL"
    if script and "SubmitLine=" in show:
        return False, "neither the submit line nor the #SBATCH directives say --no-kill"
    if script:
        return None, (
            "the batch script has no #SBATCH --no-kill, and this Slurm does not show the sbatch "
            "command line, where -k may have been given"
        )
    return None, "Slurm does not tell a job whether it was submitted with --no-kill, and no batch script was readable"


def _run_quiet(argv: list[str], timeout_s: float = 10.0) -> str | None:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def warn_if_allocation_dies_with_a_node(
    job_id: str, env: Mapping[str, str], out: TextIO = sys.stderr, run: Callable[[list[str]], str | None] = _run_quiet
) -> bool | None:
    survives, how = allocation_survives_node_failure(job_id, env, run)
    if survives is False:
        print(NO_KILL_MESSAGE.format(job=job_id) + f" (from {how})", file=out)
    elif survives is None:
        print(NO_KILL_UNKNOWN.format(job=job_id, why=how), file=out)
    return survives


# ---- the default run directory -------------------------------------------------------------------
# `.resild/job-<id>` was reused when job ids start again (a new cluster, or slurmctld's state and id
# counter wiped) and by a requeued job, mixing journals. The default name is
#   <cluster>-job-<id>-r<restarts>-<start time>
# The start time of this run is what makes it unique: the restart count alone repeats after an id
# reset (a fresh job 42 has Restarts=0 again), and SubmitTime is reset by a requeue anyway. The
# restart count is there for the operator: r1 is the first requeue of the job.
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SHOW_START = re.compile(r"\bStartTime=(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)\b")
_CONFIG_CLUSTER = re.compile(r"^ClusterName\s*=\s*(\S+)", flags=re.M)


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part).strip("._") or "x"


def cluster_name(env: Mapping[str, str], run: Callable[[list[str]], str | None] = _run_quiet) -> str:
    """SLURM_CLUSTER_NAME (set in every job since 17.x), else `scontrol show config`, else "cluster"."""
    name = env.get("SLURM_CLUSTER_NAME")
    if not name:
        m = _CONFIG_CLUSTER.search(run(["scontrol", "show", "config"]) or "")
        name = m.group(1) if m else "cluster"
    return _safe(name)


def job_start_stamp(
    job_id: str,
    env: Mapping[str, str],
    run: Callable[[list[str]], str | None] = _run_quiet,
    now: Callable[[], float] = time.time,
) -> str:
    """This run's start as YYYYmmddTHHMMSS (local time, as `scontrol show job` prints StartTime):
    SLURM_JOB_START_TIME (epoch, Slurm 23.02+), else StartTime=, else now (resil-run's own start)."""
    raw = env.get("SLURM_JOB_START_TIME", "")
    if raw.isdigit():
        return time.strftime("%Y%m%dT%H%M%S", time.localtime(int(raw)))
    m = _SHOW_START.search(run(["scontrol", "show", "job", job_id]) or "")
    if m:
        return "{}{}{}T{}{}{}".format(*m.groups())
    return time.strftime("%Y%m%dT%H%M%S", time.localtime(now()))


def default_run_dir_name(
    job_id: str,
    env: Mapping[str, str],
    run: Callable[[list[str]], str | None] = _run_quiet,
    now: Callable[[], float] = time.time,
) -> str:
    """`<cluster>-job-<id>-r<restarts>-<start>`, unique per cluster, job and run of the job."""
    restarts = env.get("SLURM_RESTART_COUNT", "0") or "0"
    return f"{cluster_name(env, run)}-job-{_safe(job_id)}-r{_safe(restarts)}-{job_start_stamp(job_id, env, run, now)}"


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_slurm(
    *,
    nodes: int | None,
    spares: int,
    nproc_per_node: int,
    inject: tuple[str, ...],
    events: Path | None,
    settings: JobSettings,
    run_dir: Path | None,
    as_json: bool,
    cmd: list[str],
    requeue_on_exhaustion: bool = False,
    status: bool = True,
    controllers: int = 1,
    etcd: EtcdTarget | None = None,
    spare_target: int = 0,
    readmit: bool = False,
) -> int:
    try:
        alloc = slurm.allocation_from_env(os.environ)
    except slurm.SlurmEnvError as e:
        raise click.UsageError(f"cannot read the Slurm allocation: {e}") from None
    if alloc is None:
        raise click.UsageError(
            "not inside a Slurm allocation (no SLURM_JOB_ID): run under sbatch/salloc, "
            "or use --local for an embedded cluster on this machine"
        )
    all_nodes = list(alloc.nodes)
    if nodes is not None:
        if nodes > len(all_nodes):
            raise click.UsageError(f"--nodes {nodes} but the allocation has {len(all_nodes)}: {alloc.nodelist}")
        all_nodes = all_nodes[:nodes]
    try:
        active, spare_nodes = slurm.split_roles(all_nodes, spares)
        faults = [parse_fault(s) for s in inject]
        # Ranks are laid out in this order and snapshot copies go to the next nodes in it:
        # neighbours behind different leaf switches survive one switch's loss.
        domains = slurm.switches(active)
        if len(set(domains.values())) > 1:
            active = slurm.interleave_by_domain(active, domains)
            n_sw = len(set(domains.values()))
            say(f"resil-run: active nodes interleaved over {n_sw} leaf switches")
    except (ValueError, FaultSpecError) as e:
        raise click.UsageError(str(e)) from None
    for f in faults:
        if f.node not in all_nodes:
            raise click.UsageError(f"fault {f} names node {f.node!r}; nodes are {', '.join(all_nodes)}")

    if settings.min_replicas > len(active) * nproc_per_node:
        raise click.UsageError(
            f"--min-replicas {settings.min_replicas} is more than the job has: {len(active)} active node(s) x "
            f"{nproc_per_node} rank(s) = {len(active) * nproc_per_node} replicas"
        )
    # Said at start, not after the first failure: by then the allocation is gone.
    warn_if_allocation_dies_with_a_node(alloc.job_id, os.environ)

    from launcher.run.job import JobSpec, run_job  # imports torch
    from launcher.run.slurm_backend import SlurmBackend

    # The controller and store must be reachable from every node: bind on all
    # interfaces, advertise this host (override with RESILD_CONTROLLER_HOST).
    host = os.environ.get(resild_env.CONTROLLER_HOST.name) or socket.getfqdn()
    rd = run_dir or Path.cwd() / ".resild" / default_run_dir_name(alloc.job_id, os.environ)
    say(f"resil-run: run dir {rd}")

    def node_cmd(endpoint: str, keys_dir: Path) -> list[str]:
        return node_command(endpoint, nproc_per_node, settings.to_dict(), cmd, keys=keys_dir)

    def make_backend(endpoint: str, keys_dir: Path) -> SlurmBackend:
        return SlurmBackend(alloc, all_nodes, node_cmd(endpoint, keys_dir), run_dir=rd if spare_target else None)

    spec = JobSpec(
        active=active,
        spares=spare_nodes,
        nproc_per_node=nproc_per_node,
        cmd=cmd,
        run_dir=rd,
        faults=faults,
        events_path=events,
        settings=settings,
        bind_host=host,
        bind_any=True,
        spare_target=spare_target,
        readmit=readmit,
    )
    if controllers > 1:
        from launcher.run.standby import run_replicated

        return run_replicated(
            spec,
            controllers,
            as_json=as_json,
            slurm_job=alloc,
            node_cmd=node_cmd,
            status=status,
            etcd=etcd,
        )
    # scancel sends the batch script SIGTERM: end like Ctrl-C, so the job's own cold-spare
    # requests are cancelled with it (no cold spare outlives the job)
    signal.signal(signal.SIGTERM, _interrupt)
    code, reason = run_job(spec, as_json=as_json, backend_factory=make_backend, return_reason=True, status=status)
    if code != 0 and requeue_on_exhaustion and reason.startswith("no spare left"):
        try:
            slurm.requeue(alloc.job_id, reason)  # requeue_cmd adds the "resild: " prefix
            say(f"resil-run: requeued job {alloc.job_id}: {reason}")
        except slurm.SlurmError as e:
            say(f"resil-run: requeue failed: {e}")
    return int(code)
