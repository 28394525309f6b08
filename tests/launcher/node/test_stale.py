"""The sweep of a re-admitted node (launcher/node/stale.py): which processes are stale (pure),
and real processes killed with everything they started, others left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from launcher.node.stale import Seen, stale_node_processes, sweep

pytestmark = pytest.mark.timeout(60)

NODE = ("python", "-m", "launcher.node", "--controller", "tcp://h:1")


def test_only_this_jobs_node_processes_on_this_node_other_than_me_are_stale() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}
    procs = [
        Seen(10, NODE, env),  # the old node process: stale
        Seen(11, NODE, env),  # me
        Seen(12, NODE, {**env, "SLURM_JOB_ID": "8"}),  # a cold spare's, another job
        Seen(13, NODE, {**env, "SLURMD_NODENAME": "n2"}),  # another node's (a lab shares /proc)
        Seen(14, ("python", "train.py"), env),  # a worker: found as a descendant, not here
        Seen(15, ("python", "-m", "resild.cli"), env),
    ]
    assert stale_node_processes(procs, me=11, job_id="7", node="n1") == [10]
    assert stale_node_processes(procs, me=11, job_id="", node="n1") == []  # outside Slurm: nothing


def _spawn(job: str, node: str) -> subprocess.Popen[bytes]:
    """A stand-in node process (its command line names the module) with one child, a worker."""
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    )
    env = {**os.environ, "SLURM_JOB_ID": job, "SLURMD_NODENAME": node}
    return subprocess.Popen([sys.executable, "-c", code, "-m", "launcher.node"], env=env)


def test_the_sweep_kills_the_stale_node_process_and_what_it_started() -> None:
    stale, other = _spawn("resild-test-job", "n1"), _spawn("resild-test-other", "n1")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not psutil.Process(stale.pid).children():
            time.sleep(0.05)
        worker = psutil.Process(stale.pid).children()[0].pid
        killed = sweep("n1", {"SLURM_JOB_ID": "resild-test-job"})
        assert killed == sorted([stale.pid, worker])
        stale.wait(10)  # (the sweep reaped it already: our child here)
        assert not psutil.pid_exists(stale.pid)
        assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None  # another job's: untouched
    finally:
        for p in (stale, other):
            for q in psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []:
                q.kill()
            p.kill()
            p.wait()
