"""The Slurm backend's bookkeeping without a Slurm (the lab runs the real steps:
tests/slurm): a re-admitted node's command line, which fenced nodes can come back, and
which exits are failures once nodes run in steps of their own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from launcher.run.slurm_backend import SlurmBackend, node_command_with
from resild.slurm import Allocation

pytestmark = pytest.mark.timeout(30)

NODE_CMD = ["python", "-m", "launcher.node", "--controller", "tcp://h:1", "--nproc", "1", "--", "train.py", "--qualify"]


def test_flags_go_to_the_node_process_never_to_the_training_command() -> None:
    out = node_command_with(NODE_CMD, "--qualify", "--replace-stale")
    assert out[: out.index("--")] == [*NODE_CMD[:7], "--qualify", "--replace-stale"]
    assert out[out.index("--") :] == ["--", "train.py", "--qualify"]  # the user's own arguments untouched
    assert node_command_with(out, "--qualify") == out  # never twice


def _backend() -> SlurmBackend:
    alloc = Allocation("42", ("n1", "n2", "n3"), "n[1-3]")
    return SlurmBackend(alloc, ["n1", "n2"], NODE_CMD, env={}, drain_nodes=False, run_dir=None)


def test_fenced_nodes_of_the_allocation_can_come_back(tmp_path: Path) -> None:
    b = _backend()
    b.fence("n2", "worker exited")
    b.fence("n9", "never in this allocation")
    assert b.restartable() == frozenset({"n2"})


def test_a_readmitted_nodes_own_step_ending_is_its_failure_and_not_the_main_steps() -> None:
    b = _backend()
    b.proc = subprocess.Popen(["true"])  # the main step, over: every node in it not fenced has failed
    b.readmitted["n2"] = subprocess.Popen(["false"])  # n2's own step, over
    b.proc.wait()
    b.readmitted["n2"].wait()
    assert sorted(b.exited_nodes()) == [("n1", 0), ("n2", 1)]  # n2 once, from its own step
    assert b.exited_nodes() == []
