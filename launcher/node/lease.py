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

from collections.abc import Mapping

import resild.wire.env as resild_env
from resild import slurm
from resild.slurm import RELEASE_MODES

ENV = resild_env.ON_CONTROLLER_LOST.name
MODES = RELEASE_MODES
DEFAULT_MODE = "requeue"


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


def release(job_id: str, reason: str, mode: str) -> str:
    """resild.slurm.release_job, saying which setting left the job alone."""
    if mode == "none":
        return f"left Slurm job {job_id} alone ({ENV}=none)"
    return slurm.release_job(job_id, reason, mode)
