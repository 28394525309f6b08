"""Slurm glue (shared by the daemon, the controller and resil-run): read the allocation, build srun/scontrol commands.

Command builders are pure (they return argv lists) so they can be tested without Slurm;
`drain` and `requeue` are thin wrappers that run them with a timeout. Every argv is
passed to subprocess without a shell, so values need no shell quoting.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import hostlist

__all__ = [
    "Allocation",
    "SlurmEnvError",
    "SlurmError",
    "allocation_from_env",
    "cancel",
    "cancel_cmd",
    "compress_nodelist",
    "drain",
    "drain_cmd",
    "expand_nodelist",
    "requeue",
    "requeue_cmd",
    "sanitize_text",
    "split_roles",
    "srun_node_launcher_cmd",
]

REASON_MAX = 200
REASON_PREFIX = "resild: "
DEFAULT_TIMEOUT_S = 10.0

_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_JOB_ID_RE = re.compile(r"^[0-9]+$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]+")
_QUOTES_RE = re.compile(r"[\"'`]")


class SlurmEnvError(ValueError):
    """The SLURM_* environment is missing pieces or contradicts itself."""


class SlurmError(RuntimeError):
    """A Slurm command failed; carries its argv, exit status and stderr."""

    def __init__(self, message: str, cmd: Sequence[str], returncode: int | None, stderr: str = "") -> None:
        super().__init__(message)
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class Allocation:
    """The job allocation as seen from inside it (batch script or job step)."""

    job_id: str
    nodes: tuple[str, ...]  # expanded SLURM_JOB_NODELIST, in Slurm's order
    nodelist: str  # the compressed form Slurm gave, e.g. "node[1-4,7]"
    node: str | None = None  # SLURMD_NODENAME: the node this process runs on
    step_id: str | None = None  # None in the batch script itself
    submit_host: str | None = None
    partition: str | None = None
    restart_count: int = 0  # SLURM_RESTART_COUNT: times the job was requeued

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def batch_host(self) -> str | None:
        """The batch host, known only when read in the batch script (no step id there)."""
        return self.node if self.step_id is None else None


def _duplicates(nodes: Sequence[str]) -> list[str]:
    return sorted(n for n, k in Counter(nodes).items() if k > 1)


def expand_nodelist(nodelist: str) -> list[str]:
    """`node[1-3,7]` -> ['node1', 'node2', 'node3', 'node7'], order kept; duplicates are an error."""
    try:
        nodes = hostlist.expand_hostlist(nodelist, allow_duplicates=True)
    except hostlist.BadHostlist as e:
        raise SlurmEnvError(f"bad Slurm node list {nodelist!r}: {e}") from None
    if not nodes or any(not n for n in nodes):
        raise SlurmEnvError(f"empty Slurm node list {nodelist!r}")
    dups = _duplicates(nodes)
    if dups:
        raise SlurmEnvError(f"node list {nodelist!r} names nodes more than once: {', '.join(dups)}")
    return list(nodes)


def compress_nodelist(nodes: Sequence[str]) -> str:
    """['node1', 'node2', 'node7'] -> 'node[1-2,7]' (sorted: Slurm ignores the order anyway)."""
    return str(hostlist.collect_hostlist(list(nodes)))


def _int_env(env: Mapping[str, str], key: str, default: int | None = None) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmEnvError(f"{key}={raw!r} is not an integer") from None


def allocation_from_env(env: Mapping[str, str]) -> Allocation | None:
    """Read the allocation from a Slurm environment; None when not inside a Slurm job."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id:
        if nodelist:
            raise SlurmEnvError("SLURM_JOB_NODELIST is set but SLURM_JOB_ID is not")
        return None
    if not _JOB_ID_RE.match(job_id):
        raise SlurmEnvError(f"SLURM_JOB_ID={job_id!r} is not a job id")
    if not nodelist:
        raise SlurmEnvError(f"SLURM_JOB_ID={job_id} but SLURM_JOB_NODELIST is missing")
    nodes = expand_nodelist(nodelist)
    # SLURM_NNODES is the *step's* node count inside a step; the job's is SLURM_JOB_NUM_NODES.
    expected = _int_env(env, "SLURM_JOB_NUM_NODES")
    if expected is not None and expected != len(nodes):
        raise SlurmEnvError(
            f"SLURM_JOB_NUM_NODES={expected} but SLURM_JOB_NODELIST={nodelist!r} has {len(nodes)} nodes"
        )
    node = env.get("SLURMD_NODENAME") or None
    if node is not None and node not in nodes:
        raise SlurmEnvError(f"SLURMD_NODENAME={node!r} is not in SLURM_JOB_NODELIST={nodelist!r}")
    restarts = _int_env(env, "SLURM_RESTART_COUNT", 0)
    assert restarts is not None
    if restarts < 0:
        raise SlurmEnvError(f"SLURM_RESTART_COUNT={restarts} is negative")
    return Allocation(
        job_id=job_id,
        nodes=tuple(nodes),
        nodelist=nodelist,
        node=node,
        step_id=env.get("SLURM_STEP_ID") or None,
        submit_host=env.get("SLURM_SUBMIT_HOST") or None,
        partition=env.get("SLURM_JOB_PARTITION") or None,
        restart_count=restarts,
    )


def _check_nodes(nodes: Sequence[str], what: str) -> None:
    if isinstance(nodes, str):
        raise TypeError(f"{what} must be a list of node names, not a string")
    bad = [n for n in nodes if not isinstance(n, str) or not _NODE_RE.match(n)]
    if bad:
        raise ValueError(f"{what}: invalid node names {bad!r}")
    dups = _duplicates(nodes)
    if dups:
        raise ValueError(f"{what}: duplicate nodes {dups}")


def split_roles(nodes: Sequence[str], spares: int) -> tuple[list[str], list[str]]:
    """Split the allocation into (active, spares); spares are the last `spares` nodes.

    The first node is usually the batch host, so it stays active.
    """
    if isinstance(spares, bool) or not isinstance(spares, int):
        raise TypeError(f"spares must be an int, got {spares!r}")
    _check_nodes(nodes, "split_roles")
    if spares < 0:
        raise ValueError(f"spares must be >= 0, got {spares}")
    if spares >= len(nodes):
        raise ValueError(
            f"{spares} spare(s) requested but the allocation has only {len(nodes)} node(s); "
            "at least one node must stay active"
        )
    cut = len(nodes) - spares
    return list(nodes[:cut]), list(nodes[cut:])


def parse_topology(text: str) -> dict[str, str]:
    """`scontrol show topology` -> node: its leaf switch (Level=0). Empty when the
    cluster has no topology plugin (the command then prints nothing useful)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("Level") != "0" or not fields.get("SwitchName") or not fields.get("Nodes"):
            continue
        try:
            members = expand_nodelist(fields["Nodes"])
        except ValueError:
            continue
        for n in members:
            out.setdefault(n, fields["SwitchName"])
    return out


def interleave_by_domain(nodes: Sequence[str], domain: Mapping[str, str]) -> list[str]:
    """Order `nodes` so that neighbours in the order sit in different failure domains
    (leaf switches) where possible: round-robin over the domains, each in its own order,
    the first node kept first (the batch host). Snapshot copies go to the next nodes in
    rank order, so this puts them behind other switches. Pure; unknown nodes are a
    domain each."""
    if not nodes:
        return []
    groups: dict[str, list[str]] = {}
    for n in nodes:
        groups.setdefault(domain.get(n, f"\0{n}"), []).append(n)
    queues = list(groups.values())
    out: list[str] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def switches(
    nodes: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Best effort: the leaf switch of each node, or {} when Slurm does not know."""
    try:
        p = subprocess.run(["scontrol", "show", "topology"], capture_output=True, text=True, timeout=timeout_s, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if p.returncode != 0:
        return {}
    topo = parse_topology(p.stdout)
    return {n: topo[n] for n in nodes if n in topo}


def srun_node_launcher_cmd(
    alloc: Allocation,
    nodes: Sequence[str],
    cmd: Sequence[str],
    extra_env: Mapping[str, str] | None = None,
) -> list[str]:
    """One srun step running `cmd` once on each of `nodes` (one node-launcher per node).

    --no-kill / --kill-on-bad-exit=0 / --wait=0: one node's death or failure must not take
    the other node-launchers down (WaitTime in slurm.conf would otherwise kill them).
    --overlap: later steps (e.g. on a spare) may share the nodes. --whole: the launcher
    needs every CPU/GPU of its node for its workers, not the one CPU a task gets by default.
    Task ranks follow Slurm's node order, not `nodes`: identify a node by SLURMD_NODENAME.
    """
    _check_nodes(nodes, "srun_node_launcher_cmd")
    if not nodes:
        raise ValueError("srun_node_launcher_cmd: no nodes")
    outside = [n for n in nodes if n not in alloc.nodes]
    if outside:
        raise ValueError(f"nodes {outside} are not in job {alloc.job_id}'s allocation {alloc.nodelist}")
    if isinstance(cmd, str) or not cmd:
        raise ValueError("cmd must be a non-empty argv list")
    env_prefix: list[str] = []
    for key, value in (extra_env or {}).items():
        if not _ENV_KEY_RE.match(key):
            raise ValueError(f"invalid environment variable name {key!r}")
        env_prefix.append(f"{key}={value}")
    if env_prefix:
        if "=" in cmd[0]:
            raise ValueError(f"cmd[0] {cmd[0]!r} contains '=' and would be read by env(1) as a variable")
        # via env(1), not --export=ALL,K=V: srun splits --export at every comma, even in values
        env_prefix = ["env", *env_prefix]
    return [
        "srun",
        f"--jobid={alloc.job_id}",
        "--no-kill",
        "--kill-on-bad-exit=0",
        "--wait=0",
        "--overlap",
        "--whole",
        "-N",
        str(len(nodes)),
        "--ntasks-per-node=1",
        f"--nodelist={compress_nodelist(nodes)}",
        "--export=ALL",
        *env_prefix,
        *cmd,
    ]


def sanitize_text(text: str, limit: int = REASON_MAX) -> str:
    """One line, no quotes, at most `limit` characters: safe as a Slurm reason or comment."""
    text = _QUOTES_RE.sub("", _CONTROL_RE.sub(" ", str(text)))
    text = " ".join(text.split())[:limit].rstrip()
    if not text:
        raise ValueError("reason/comment is empty after sanitising")
    return text


def drain_cmd(node: str, reason: str) -> list[str]:
    """scontrol update NodeName=<node> State=DRAIN Reason="resild: <reason>"."""
    if not isinstance(node, str) or not _NODE_RE.match(node):
        raise ValueError(f"invalid node name {node!r} (one node, no host list)")
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={REASON_PREFIX}{sanitize_text(reason)}"]


def requeue_cmd(job_id: str | int, comment: str) -> list[list[str]]:
    """The two commands of a requeue: set the job's comment first (so it says why even if the
    requeue is refused), then `scontrol requeue`. The comment survives the requeue."""
    jid = str(job_id)
    if not _JOB_ID_RE.match(jid):
        raise ValueError(f"invalid job id {job_id!r}")
    return [
        ["scontrol", "update", f"JobId={jid}", f"Comment={REASON_PREFIX}{sanitize_text(comment)}"],
        ["scontrol", "requeue", jid],
    ]


def _run(cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> None:
    _output(cmd, timeout_s, env)


def _output(
    cmd: Sequence[str], timeout_s: float, env: Mapping[str, str] | None, ok_codes: tuple[int, ...] = (0,)
) -> str:
    try:
        res = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout_s, env=dict(env) if env is not None else None
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(cmd)} timed out after {timeout_s:g}s", cmd, None) from None
    except OSError as e:
        raise SlurmError(f"{' '.join(cmd)} could not run: {e}", cmd, None) from None
    if res.returncode not in ok_codes:
        err = res.stderr.strip() or res.stdout.strip()
        raise SlurmError(f"{' '.join(cmd)} failed (exit {res.returncode}): {err}", cmd, res.returncode, err)
    return res.stdout


def drain(node: str, reason: str, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> None:
    """Drain `node` so no new job lands on it; running steps keep going. Raises SlurmError."""
    _run(drain_cmd(node, reason), timeout_s, env)


def requeue(
    job_id: str | int, comment: str, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> None:
    """Put the job back in the queue with a comment saying why. Raises SlurmError.

    Called from the job's own batch script, the requeue kills that script too.
    """
    for cmd in requeue_cmd(job_id, comment):
        _run(cmd, timeout_s, env)


def job_fields(
    job_id: str | int, timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`scontrol show job -o <id>` as a dict (Account, Partition, Features, ...). Raises SlurmError."""
    jid = str(job_id)
    if not _JOB_ID_RE.match(jid):
        raise ValueError(f"invalid job id {job_id!r}")
    out = _output(["scontrol", "show", "job", "-o", jid], timeout_s, env)
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def cold_spare_cmd(run_dir: str, python: str, job: Mapping[str, str], out: str) -> list[str]:
    """sbatch of a one-node cold-spare job for the job `job` (its scontrol fields): the same
    account, partition, QOS and constraints, its name, and `resil-run --join RUN_DIR`."""
    cmd = ["sbatch", "--parsable", "-N", "1", "--exclusive", "--no-requeue", f"--output={out}"]
    for flag, key in (("--account", "Account"), ("--partition", "Partition"), ("--qos", "QOS")):
        v = job.get(key, "")
        if v and v != "(null)":
            cmd.append(f"{flag}={v}")
    feats = job.get("Features", "")
    if feats and feats != "(null)":
        cmd.append(f"--constraint={feats}")
    name = job.get("JobName", "")
    cmd.append(f"--job-name=resild-spare-{job.get('JobId', '')}-{name}"[:128] if name else "--job-name=resild-spare")
    cmd.append(f"--wrap={shlex.quote(python)} -m launcher.run.cli --join {shlex.quote(run_dir)}")
    return cmd


def submit(cmd: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None) -> str:
    """Run an `sbatch --parsable` command; the job id. Raises SlurmError."""
    jid = _output(cmd, timeout_s, env).strip().split(";")[0]
    if not _JOB_ID_RE.match(jid):
        raise SlurmError(f"{' '.join(cmd)}: no job id in its answer {jid!r}", list(cmd), 0)
    return jid


def alive(
    job_ids: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> set[str]:
    """Which of `job_ids` are still in the queue (pending, running, completing)."""
    if not job_ids:
        return set()
    out = _output(["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)], timeout_s, env, ok_codes=(0, 1))
    return {j for j in out.split() if j in set(job_ids)}


def cancel_cmd(job_id: str | int, only_running: bool = True) -> list[str]:
    """`scancel [--state=RUNNING] <jobid>`. With only_running, a job that is pending or being
    requeued (COMPLETING on its way back to PENDING) is left alone: a plain scancel of a job
    being requeued cancels the requeue (measured on Slurm 22.05)."""
    jid = str(job_id)
    if not _JOB_ID_RE.match(jid):
        raise ValueError(f"invalid job id {job_id!r}")
    return ["scancel", "--state=RUNNING", jid] if only_running else ["scancel", jid]


def cancel(
    job_id: str | int,
    only_running: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> None:
    """Cancel the job (see cancel_cmd). Raises SlurmError.

    scancel exits 0, silently, for a job already gone or not in the state asked for."""
    _run(cancel_cmd(job_id, only_running), timeout_s, env)


# -- releasing an allocation whose controller is gone (one path: a node process whose lease ran
# out, launcher/node/lease.py; a standby leader whose resil-run died, resild/controller/replica.py)

# What became of the requeue (after_requeue's answer)
REQUEUED = "requeued"  # this node process requeued the job
ALREADY_REQUEUED = "already_requeued"  # another one did: the job is pending (or on its way)
GONE = "gone"  # the job has ended already: nothing to release
CANCEL = "cancel"  # not requeueable, or the requeue failed: cancel it

RequeueFn = Callable[..., None]  # slurm.requeue(job_id, comment, timeout_s=...): raises SlurmError
CancelFn = Callable[..., None]  # slurm.cancel(job_id, timeout_s=...): raises SlurmError


def after_requeue(err: SlurmError | None) -> str:
    """The decision, from the result of the comment + requeue commands (None: both succeeded).

    Messages measured on Slurm 22.05: a second requeue (job completing or pending after the
    first) says "Job is pending execution"; a job that is not requeueable says "Requested
    operation is presently disabled"; an ended job "Job has already finished" (comment update)
    or "Invalid job id specified" (purged). A timeout or any other error: cancel."""
    if err is None:
        return REQUEUED
    text = f"{err.stderr} {err}".lower()
    if "pending execution" in text:
        return ALREADY_REQUEUED
    if "already finished" in text or "invalid job id" in text or "already completing or completed" in text:
        return GONE
    return CANCEL


def _why(err: SlurmError) -> str:
    text = (err.stderr or str(err)).strip()
    first = text.splitlines()[0] if text else "error"
    return first.removeprefix("slurm_update error: ").removeprefix("scontrol: error: ")[:160]


RELEASE_MODES = ("requeue", "cancel", "none")


def release_job(
    job_id: str,
    reason: str,
    mode: str = "requeue",
    *,
    requeue_fn: RequeueFn = requeue,
    cancel_fn: CancelFn = cancel,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Release the allocation as `mode` says; returns what happened, as a fragment of the node
    process's one line ("requeued Slurm job 42", ...). Never raises SlurmError.

      requeue  the comment says why, then `scontrol requeue`; if that is refused (not
               requeueable) or fails, `scancel --state=RUNNING` (a job being requeued is
               left alone: a plain scancel would cancel the requeue)
      cancel   `scancel --state=RUNNING` only
      none     nothing"""
    if mode == "none":
        return f"left Slurm job {job_id} alone"
    if mode == "requeue":
        err: SlurmError | None = None
        try:
            requeue_fn(job_id, reason, timeout_s=timeout_s)
        except SlurmError as e:
            err = e
        decision = after_requeue(err)
        if decision == REQUEUED:
            return f"requeued Slurm job {job_id}"
        if decision == ALREADY_REQUEUED:
            return f"Slurm job {job_id} already requeued"
        if decision == GONE:
            return f"Slurm job {job_id} already ended"
        assert err is not None
        first = f"could not requeue Slurm job {job_id} ({_why(err)}): "
    else:
        first = ""
    try:
        cancel_fn(job_id, timeout_s=timeout_s)
    except SlurmError as e:
        return f"{first}scancel {job_id} failed ({_why(e)})"
    return first + ("cancelled it" if first else f"cancelled Slurm job {job_id}")
