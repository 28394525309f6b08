"""Cold spares from the Slurm queue: `sbatch --wrap "resil-run --join RUN_DIR"` joins a running
job on the lab cluster, qualifies, and takes a crashed node's ranks; no cold-spare job outlives
the job it joined (it finished, or it was cancelled). And nodes that come back: a suspect node
re-admitted in a new step (--readmit).

The lab's nodes have no GPU: the cold spare's qualification reads the NVML stand-in (one
healthy GPU) and runs its self-test on the CPU.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from bench.commands import resil_run, shell_line
from resild.health.fakenvml import build_fake_nvml
from tests.slurmlab.fixture import SlurmLab

from .test_resilrun import HOLD_STEP, REPO, Job, lab, reference  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def _stand_in(tmp: Path) -> str:
    """The environment that gives a lab node one healthy stand-in GPU (for qualification)."""
    nvml = build_fake_nvml(tmp / "fake-nvml")
    (tmp / "nvml.ctl").write_text("gpus 1\n")
    return f"export LD_LIBRARY_PATH={nvml} FAKE_NVML_CONTROL={tmp}/nvml.ctl RESILD_CFG_PROBES=gpu"


def _cold_spare(lab: SlurmLab, tmp: Path, run_dir: Path) -> str:  # noqa: F811
    """Submit a one-node cold-spare job; its id."""
    script = tmp / "spare.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -N 1
#SBATCH --exclusive
#SBATCH -t 5
#SBATCH -o {tmp}/spare-%j.out
{_stand_in(tmp)}
cd {REPO}
exec {shell_line(resil_run("--join", str(run_dir), local=False))}
""")
    return lab.run(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]


def _gone(lab: SlurmLab, jid: str, timeout_s: float) -> bool:  # noqa: F811
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if jid not in lab.run(["squeue", "-h", "-o", "%i"]).stdout.split():
            return True
        time.sleep(0.5)
    return False


def test_a_cold_spare_from_the_queue_joins_and_takes_a_crashed_nodes_ranks(
    lab: SlurmLab,  # noqa: F811
    tmp_path: Path,
    reference: dict,  # noqa: F811
) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, held=True)  # no start-up spare at all
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    spare_jid = _cold_spare(lab, tmp_path, tmp_path / "run")
    admitted = job.wait_event(lambda e: e["event"] == "node_admitted", timeout_s=120)
    spare = admitted["node"]
    assert spare not in job.active_nodes()
    job.wait_event(lambda e: e["event"] == "worker_registered" and e["node"] == spare, timeout_s=120)  # qualified, warm
    lab.crash(victim)
    job.release()
    took = job.wait_event(lambda e: e["event"] == "spare_assigned")
    assert (took["failed"], took["spare"]) == (victim, spare), took
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    final = job.final()
    assert final["step"] == reference["step"] and all(
        (v == final["model"][k]).all() for k, v in reference["model"].items()
    )
    # the cold-spare job ends with the job it joined (its node process told to shut down)
    assert _gone(lab, spare_jid, 60), lab.run(["squeue"]).stdout
    out = next(tmp_path.glob("spare-*.out")).read_text()
    assert f"{spare} (Slurm job {spare_jid}) joined job" in out, out[-2000:]
    assert HOLD_STEP < final["step"]


def test_cancelling_the_job_leaves_no_cold_spare_in_the_queue(lab: SlurmLab, tmp_path: Path) -> None:  # noqa: F811
    job = Job(lab, tmp_path, nodes=2, spares=0, held=True)  # held: it waits for us at step 20
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    spare_jid = _cold_spare(lab, tmp_path, tmp_path / "run")
    spare = job.wait_event(lambda e: e["event"] == "node_admitted", timeout_s=120)["node"]
    job.wait_event(lambda e: e["event"] == "node_registered" and e["node"] == spare, timeout_s=120)
    lab.run(["scancel", job.jid])
    # its controller gone, the cold spare's node process cancels its own job (never requeues it)
    assert _gone(lab, spare_jid, 60), lab.run(["squeue"]).stdout
    assert _gone(lab, job.jid, 60)


def test_the_job_asks_the_queue_for_a_spare_when_its_pool_is_spent(
    lab: SlurmLab,  # noqa: F811
    tmp_path: Path,
    reference: dict,  # noqa: F811
) -> None:
    # 2 active + 1 hot spare; --spare-target 1: once the hot spare is spent, a cold spare is asked for
    job = Job(lab, tmp_path, nodes=3, spares=1, extra="--spare-target 1", held=True, setup=_stand_in(tmp_path))
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    assert not any(e["event"] == "spares_requested" for e in job.events())  # the pool is at its target
    lab.crash(victim)
    job.wait_event(lambda e: e["event"] == "spare_assigned")
    asked = job.wait_event(lambda e: e["event"] == "spares_requested", timeout_s=30)
    assert asked["count"] == 1, asked
    joined = job.wait_event(lambda e: e["event"] == "node_admitted", timeout_s=120)
    assert joined["source"].startswith("slurm:"), joined
    cold_jid = joined["source"].removeprefix("slurm:")
    job.wait_event(lambda e: e["event"] == "worker_registered" and e["node"] == joined["node"], timeout_s=120)
    job.release()
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    final = job.final()
    assert all((v == final["model"][k]).all() for k, v in reference["model"].items())
    assert len([e for e in job.events() if e["event"] == "spares_requested"]) == 1  # one gap, one request
    assert _gone(lab, cold_jid, 60), lab.run(["squeue"]).stdout  # no cold spare outlives the job


def test_a_suspect_node_comes_back_in_a_new_step_and_takes_ranks_again(
    lab: SlurmLab,  # noqa: F811
    tmp_path: Path,
    reference: dict,  # noqa: F811
) -> None:
    """--readmit under Slurm: a node fenced on suspicion (its worker was killed: no evidence
    against the node) is still in the allocation; a new step on it sweeps what is left of its
    old node process, qualifies, and the node takes a crashed node's ranks later."""
    job = Job(lab, tmp_path, nodes=3, spares=1, extra="--readmit", held=True, setup=_stand_in(tmp_path))
    host = job.wait_event(lambda e: e["event"] == "job_started")["controller_host"]
    suspect = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    pid = [e["pid"] for e in job.events() if e["event"] == "worker_registered" and e["node"] == suspect][-1]
    os.kill(pid, signal.SIGKILL)  # the worker, not the node: no evidence against the node
    job.wait_event(lambda e: e["event"] == "spare_assigned" and e["failed"] == suspect)
    assert job.wait_event(lambda e: e["event"] == "node_suspect" and e["node"] == suspect)["strikes"] == 1
    back = job.wait_event(lambda e: e["event"] == "node_readmitted" and e["node"] == suspect, timeout_s=60)
    job.wait_event(
        lambda e: e["event"] == "worker_registered" and e["node"] == suspect and e["t_mono"] > back["t_mono"],
        timeout_s=120,
    )  # qualified in its new step, warm
    m = [e for e in job.events() if e["event"] == "membership"][-1]
    target = next(n for n in m["layout"] if n not in (host, suspect))
    lab.crash(target)
    took = job.wait_event(lambda e: e["event"] == "spare_assigned" and e["failed"] == target)
    assert took["spare"] == suspect, took
    job.release()
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    final = job.final()
    assert final["step"] == reference["step"] and all(
        (v == final["model"][k]).all() for k, v in reference["model"].items()
    )
    assert "re-admitting" in (tmp_path / "slurm.out").read_text()
