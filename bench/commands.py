"""The command lines that bench/ and the tests start jobs with: resil-run, torchrun (and
torchrun-like launchers) and the training script they run.

One place, so that a flag renamed in resil-run is renamed here once. The builders only put
words in order; each caller keeps its own flags (``*options``), in its own order. The
tests import this module as they import the rest of bench/ (``tests/bench``,
``tests/resild/report``), and it imports nothing of bench/, tests/ or torch: scripts run
by path can import it as soon as the repository root is on ``sys.path``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"  # the training script of most jobs (bitwise reproducible)

RESIL_RUN_MODULE = "launcher.run.cli"  # `resil-run`, as `python -m` runs it (this tree, this venv)
TORCHRUN_MODULE = "torch.distributed.run"  # `torchrun`


def repeated(flag: str, values: Iterable[str]) -> list[str]:
    """``[flag, v1, flag, v2, ...]``: a flag given once per value (``--inject``)."""
    return [word for v in values for word in (flag, v)]


def resil_run(
    *options: str,
    worker: Sequence[str] | None = None,
    local: bool = True,
    nodes: int | None = None,
    spares: int | None = None,
    nproc_per_node: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m launcher.run.cli [--local] [--nodes N] [--spares S] [--nproc-per-node P]
    OPTIONS... [-- WORKER...]``. ``local=False``: under Slurm (the allocation's nodes);
    a ``None`` count leaves its flag out (resil-run's default); ``worker=None``: no ``--``
    (a command that fails before it would start one)."""
    cmd = [python, "-m", RESIL_RUN_MODULE]
    if local:
        cmd.append("--local")
    for flag, n in (("--nodes", nodes), ("--spares", spares), ("--nproc-per-node", nproc_per_node)):
        if n is not None:
            cmd += [flag, str(n)]
    cmd += options
    if worker is not None:
        cmd += ["--", *worker]
    return cmd


def torchrun(
    *script: str,
    nproc_per_node: int,
    max_restarts: int | None = None,
    monitor_interval: float | None = None,
    module: str = TORCHRUN_MODULE,
    python: str = sys.executable,
) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N [--max-restarts R]
    [--monitor-interval S] SCRIPT...``: one machine, its own rendezvous. ``script``: the
    script and its arguments (anything more for the launcher first). ``module``: a
    torchrun-like launcher (NVRx's ft_launcher) with the same flags."""
    cmd = [python, "-m", module, "--standalone", "--nproc-per-node", str(nproc_per_node)]
    if max_restarts is not None:
        cmd += ["--max-restarts", str(max_restarts)]
    if monitor_interval is not None:
        cmd += ["--monitor-interval", str(monitor_interval)]
    return cmd + list(script)


def train(
    steps: int,
    save: Path | str | None = None,
    script: Path | str | Sequence[str] = TRAIN,
    python: str | None = sys.executable,
) -> list[str]:
    """``python SCRIPT --steps N [--save FILE]``: examples/train.py (or ``script``: a path,
    or a path and its first arguments) as a job's worker command; ``python=None``: the
    script runs by itself (an executable wrapper)."""
    head = [str(script)] if isinstance(script, (str, Path)) else list(script)
    if python is not None:
        head.insert(0, python)
    return [*head, "--steps", str(steps), *(["--save", str(save)] if save is not None else [])]


def shell_line(argv: Sequence[str]) -> str:
    """``argv`` as one line of a shell script (a batch script's), each word quoted as needed."""
    return shlex.join(argv)
