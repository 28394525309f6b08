"""resil-run as the srun wrapper on a real slurmctld/slurmd lab cluster.

Each job: 3 nodes (2 active x 1 rank + 1 hot spare) unless said otherwise.
Node failures are real: every process in the node's namespace is killed
(crash) or stopped (freeze), slurmd included.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.slurmlab.fixture import SlurmLab

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 150


class Job:
    def __init__(self, lab: SlurmLab, tmp: Path, nodes: int = 3, spares: int = 1, extra: str = "",
                 steps: int = STEPS, run_dir: bool = True, train: str = "") -> None:
        self.lab, self.tmp = lab, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        script = tmp / "job.sh"
        py = sys.executable
        # without --run-dir resil-run makes its default under the current directory: tmp, not the repo
        where, rd = (REPO, f"--run-dir {tmp}/run") if run_dir else (tmp, "")
        train = train or f"{py} {REPO}/examples/train.py"
        script.write_text(f"""#!/bin/bash
#SBATCH -N {nodes}
#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH --requeue
#SBATCH -t 5
#SBATCH -o {tmp}/slurm.out
export RESILD_CONTROLLER_HOST=127.0.0.1
cd {where}
{py} -m launcher.cli --spares {spares} --nproc-per-node 1 --heartbeat-timeout 1.5 \\
  --events {tmp}/events.jsonl {rd} --json {extra} \\
  -- {train} --steps {steps} --save {tmp}/final.pt > {tmp}/summary.json
rc=$?
echo $rc > {tmp}/rc
exit $rc
""")
        self.jid = lab.run(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]

    def events(self) -> list[dict]:
        p = self.tmp / "events.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return out

    def wait_event(self, pred, timeout_s: float = 90.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e
            time.sleep(0.1)
        raise AssertionError(f"event not seen in {timeout_s}s; log: {(self.tmp / 'slurm.out').read_text()[-2000:]}")

    def active_nodes(self) -> list[str]:
        m = self.wait_event(lambda e: e["event"] == "membership")
        return list(m["layout"])

    def victim(self) -> str:
        """An active node that is not the batch host: the batch host runs the embedded
        controller, and losing it is losing the job (use a cluster controller for that)."""
        host = self.wait_event(lambda e: e["event"] == "job_started")["controller_host"]
        return next(n for n in self.active_nodes() if n != host)

    def wait(self, timeout_s: float = 150.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not (self.tmp / "rc").exists():
            if time.monotonic() > deadline:
                self.lab.run(["scancel", self.jid], check=False)
                raise AssertionError(f"job {self.jid} did not finish in {timeout_s}s")
            time.sleep(0.2)
        return int((self.tmp / "rc").read_text())

    def summary(self) -> dict:
        return json.loads((self.tmp / "summary.json").read_text())

    def final(self) -> dict:
        return torch.load(self.tmp / "final.pt")


@pytest.fixture
def lab(slurm_lab: SlurmLab):
    yield slurm_lab
    for node in slurm_lab.nodes:  # leave every node usable for the next test
        slurm_lab.restore(node)


@pytest.fixture(scope="module")
def reference(slurm_lab: SlurmLab, tmp_path_factory) -> dict:
    job = Job(slurm_lab, tmp_path_factory.mktemp("slurm-ref"))
    assert job.wait() == 0, (job.tmp / "slurm.out").read_text()
    assert job.summary()["failures"] == []
    return job.final()


def _equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())


def _first_full_step_s(job: Job, t_fault: float) -> float:
    e = job.wait_event(lambda e: e["event"] == "full_strength_step" and e["epoch"] == 2)
    return e["t_mono"] - t_fault


def test_clean_run(reference: dict) -> None:
    assert reference["step"] == STEPS


def test_node_crash_spare_takes_over_and_node_is_drained(lab: SlurmLab, tmp_path: Path, reference: dict) -> None:
    job = Job(lab, tmp_path)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    time.sleep(1.0)
    t_fault = time.monotonic()
    lab.crash(victim)
    recovery_s = _first_full_step_s(job, t_fault)
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    _equal(reference, job.final())
    (f,) = job.summary()["failures"]
    # A survivor's collective fails at once (peer reset) and the controller's liveness
    # probe finds the dead node in 0.5 s; heartbeats (1.5 s here) are the fallback.
    assert f["node"] == victim and f["detector"] in ("probe", "heartbeat") and f["steps_lost"] == 0
    reasons = lab.sinfo_reasons()
    assert reasons.get(victim, "").startswith("resild: "), reasons
    print(f"\nslurm node crash -> first full-strength step: {recovery_s:.2f}s")


def test_frozen_node_is_replaced(lab: SlurmLab, tmp_path: Path, reference: dict) -> None:
    job = Job(lab, tmp_path)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    time.sleep(1.0)
    lab.freeze(victim)
    job.wait_event(lambda e: e["event"] == "spare_assigned")
    lab.thaw(victim)  # it wakes up fenced: told to die, never rejoins
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    _equal(reference, job.final())
    (f,) = job.summary()["failures"]
    assert f["node"] == victim and "no heartbeat" in f["cause"]
    assert lab.sinfo_reasons().get(victim, "").startswith("resild: ")


def test_spares_exhausted_exits_nonzero_with_reason(lab: SlurmLab, tmp_path: Path) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, steps=100)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(victim)
    rc = job.wait()
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 1, out
    assert f"resil-run: job failed: no spare left: {victim} failed" in out
    assert job.summary()["exit_code"] == 1


def test_two_jobs_at_once_do_not_interfere(lab: SlurmLab, tmp_path: Path) -> None:
    # 2 + 2 nodes of the 4-node lab, each job with its own embedded controller and store.
    a = Job(lab, tmp_path / "a", nodes=2, spares=0, steps=400)
    b = Job(lab, tmp_path / "b", nodes=2, spares=0, steps=400)
    a_victim = a.victim()
    b.active_nodes()
    a.wait_event(lambda e: e["event"] == "full_strength_step")
    b.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(a_victim)  # only job a loses a node (and, with no spare, fails cleanly)
    assert a.wait() == 1 and b.wait() == 0
    assert len(a.summary()["failures"]) == 1 and b.summary()["failures"] == []
    assert set(a.active_nodes()).isdisjoint(b.active_nodes())
    ea = a.wait_event(lambda e: e["event"] == "job_started")["endpoint"]
    eb = b.wait_event(lambda e: e["event"] == "job_started")["endpoint"]
    assert ea != eb


def test_requeue_on_exhaustion_puts_the_reason_in_the_comment(lab: SlurmLab, tmp_path: Path) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, steps=400, extra="--requeue-on-exhaustion")
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(victim)
    job.wait_event(lambda e: e["event"] == "job_failed")
    deadline = time.monotonic() + 60
    info = ""
    while time.monotonic() < deadline:
        info = lab.run(["scontrol", "show", "job", "-o", job.jid]).stdout
        if "Restarts=1" in info and "Comment=resild: no spare left" in info:
            break
        time.sleep(0.3)
    lab.run(["scancel", job.jid], check=False)  # do not let the requeued job run again
    assert "Restarts=1" in info and f"Comment=resild: no spare left: {victim} failed" in info, \
        (info, (tmp_path / "slurm.out").read_text()[-2000:])


def test_default_run_dir_is_unique_per_cluster_job_and_run(lab: SlurmLab, tmp_path: Path) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, steps=20, run_dir=False)
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    out = (tmp_path / "slurm.out").read_text()
    (line,) = [x for x in out.splitlines() if x.startswith("resil-run: run dir ")]
    rd = Path(line.removeprefix("resil-run: run dir "))
    start = re.search(r"\bStartTime=(\S+)", lab.run(["scontrol", "show", "job", job.jid]).stdout).group(1)
    stamp = start.replace("-", "").replace(":", "")
    assert rd == tmp_path / ".resild" / f"resildlab-job-{job.jid}-r0-{stamp}", (rd, start)
    assert (rd / "journal.jsonl").exists()
