"""What a node process does with its Slurm job when its controller lease runs out.

Under Slurm the controller runs in the batch script, on the batch host. When that host dies,
Slurm 22.05 (--no-kill) cuts it out of the job and leaves the job RUNNING, holding every other
node, until its time limit; it never requeues it (docs/slurm-batch-host.md). So a node process
whose lease ran out, after killing its workers, releases the allocation itself:

  requeue (default)  `scontrol update JobId=N Comment="resild: controller lost (...)"` and
                     `scontrol requeue N`; if the job cannot be requeued (not requeueable:
                     "Requested operation is presently disabled", or any other error),
                     `scancel --state=RUNNING N`.
  cancel             `scancel --state=RUNNING N` only.
  none               leave the job alone (it holds its nodes until the time limit).

Set with RESILD_ON_CONTROLLER_LOST=requeue|cancel|none. Every node process does this at about
the same time; that is harmless: the first requeue wins, the others see "Job is pending
execution" and do nothing, and `--state=RUNNING` keeps a late scancel off a job being requeued.
Every command has a timeout. Outside a Slurm job step nothing is done.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from resild import slurm
from resild.slurm import SlurmError

ENV = "RESILD_ON_CONTROLLER_LOST"
MODES = ("requeue", "cancel", "none")
DEFAULT_MODE = "requeue"
TIMEOUT_S = 10.0

# What became of the requeue (after_requeue's answer)
REQUEUED = "requeued"  # this node process requeued the job
ALREADY_REQUEUED = "already_requeued"  # another one did: the job is pending (or on its way)
GONE = "gone"  # the job has ended already: nothing to release
CANCEL = "cancel"  # not requeueable, or the requeue failed: cancel it

RequeueFn = Callable[..., None]  # slurm.requeue(job_id, comment, timeout_s=...): raises SlurmError
CancelFn = Callable[..., None]  # slurm.cancel(job_id, timeout_s=...): raises SlurmError


def slurm_job_id(env: Mapping[str, str], node: str) -> str | None:
    """The job to release: only in a node process that srun started (a job step on `node`).
    resil-run --local inside an allocation (no step, or node names local-nodeN) is left out."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id or not job_id.isdigit() or not env.get("SLURM_STEP_ID"):
        return None
    return job_id if env.get("SLURMD_NODENAME") == node else None


def mode_from_env(env: Mapping[str, str]) -> tuple[str, str]:
    """(mode, note): note is non-empty when the setting was not understood (the default is used)."""
    raw = env.get(ENV, "").strip().lower()
    if not raw:
        return DEFAULT_MODE, ""
    if raw in MODES:
        return raw, ""
    return DEFAULT_MODE, f"{ENV}={raw!r} unknown, used {DEFAULT_MODE}"


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


def release_job(
    job_id: str,
    reason: str,
    mode: str = DEFAULT_MODE,
    *,
    requeue: RequeueFn = slurm.requeue,
    cancel: CancelFn = slurm.cancel,
    timeout_s: float = TIMEOUT_S,
) -> str:
    """Release the allocation as `mode` says; returns what happened, as a fragment of the node
    process's one line ("requeued Slurm job 42", ...). Never raises SlurmError."""
    if mode == "none":
        return f"left Slurm job {job_id} alone ({ENV}=none)"
    if mode == "requeue":
        err: SlurmError | None = None
        try:
            requeue(job_id, reason, timeout_s=timeout_s)
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
        cancel(job_id, timeout_s=timeout_s)
    except SlurmError as e:
        return f"{first}scancel {job_id} failed ({_why(e)})"
    return first + ("cancelled it" if first else f"cancelled Slurm job {job_id}")
