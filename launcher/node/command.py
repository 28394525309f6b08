"""The node process's command line (`python -m launcher.node`, launcher/node/process.py's
flags), for everything that starts one: resil-run's local cluster (launcher/run/local.py),
its Slurm step (launcher/run/slurm_mode.py) and nodes joining a running job
(launcher/run/join.py). Nothing heavy is imported: resil-run on a batch host reads it."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MODULE = "launcher.node"


def node_command(
    controller: str,
    nproc: int,
    settings: Mapping[str, Any],
    cmd: Sequence[str],
    *,
    node: str | None = None,
    keys: Path | str | None = None,
    qualify: bool = False,
    replace_stale: bool = False,
    nvml_control: Path | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m launcher.node [--node N] --controller C [--keys DIR] --nproc P --settings JSON
    [--qualify] [--replace-stale] [--nvml-control FILE] -- CMD...``. ``settings``: the job's JobSettings as a
    dict; ``node=None``: the node is $SLURMD_NODENAME (one srun step runs the same command on
    every node); ``keys``: the node's key directory (under Slurm, the job's: each node picks
    its own, launcher/run/slurm_backend.per_node_keys)."""
    argv = [python, "-m", MODULE]
    if node is not None:
        argv += ["--node", node]
    argv += ["--controller", controller]
    if keys is not None:
        argv += ["--keys", str(keys)]
    argv += ["--nproc", str(nproc), "--settings", json.dumps(settings)]
    if qualify:
        argv.append("--qualify")
    if replace_stale:
        argv.append("--replace-stale")
    if nvml_control is not None:
        argv += ["--nvml-control", str(nvml_control)]
    return [*argv, "--", *cmd]
