"""resil-run as the srun wrapper on a real slurmctld/slurmd lab cluster.

Each job: 3 nodes (2 active x 1 rank + 1 hot spare) unless said otherwise.
Node failures are real: every process in the node's namespace is killed
(crash) or stopped (freeze), slurmd included.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from bench.commands import resil_run, shell_line
from bench.commands import train as train_cmd
from tests.slurmlab.fixture import SlurmLab

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
STEPS = 150
HOLD_STEP = 20  # a held job waits before this step until the test releases it (held_train.py)
# A held job is, to the controller, hung: its hang timeout exceeds the hold's own bound
# (held_train.RELEASE_WAIT_S), as the local join tests' do. Cold-spare tests hold the job
# while a spare is queued, admitted and warmed, which a loaded machine stretches past 10 s.
HELD_HANG_TIMEOUT_S = 270


class Job:
    def __init__(
        self,
        lab: SlurmLab,
        tmp: Path,
        nodes: int = 3,
        spares: int = 1,
        extra: str = "",
        steps: int = STEPS,
        run_dir: bool = True,
        train: str = "",
        requeue: bool = True,
        minutes: int = 5,
        node_logs: bool = False,
        after: str = "",
        held: bool = False,
        setup: str = "",
    ) -> None:
        """held: the job waits before HOLD_STEP until release(), so a fault the test injects
        from outside lands while it runs, however loaded the machine."""
        self.lab, self.tmp = lab, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        script = tmp / "job.sh"
        py = sys.executable
        # without --run-dir resil-run makes its default under the current directory: tmp, not the repo
        where, rd = (REPO, ["--run-dir", f"{tmp}/run"]) if run_dir else (tmp, [])
        save = f"{tmp}/final.pt"
        if held:  # examples/train.py, held
            assert not train, "a held job runs examples/train.py"
            worker = train_cmd(steps, save, [f"{REPO}/tests/held_train.py", f"{tmp}/release", str(HOLD_STEP)], py)
        elif train:  # an executable of the test's
            worker = train_cmd(steps, save, shlex.split(train), python=None)
        else:
            worker = train_cmd(steps, save, f"{REPO}/examples/train.py", py)
        events = f"{tmp}/events.jsonl"
        hang = ["--hang-timeout", str(HELD_HANG_TIMEOUT_S)] if held else []
        opts = ["--heartbeat-timeout", "1.5", *hang, "--events", events, *rd, "--json", *shlex.split(extra)]
        resil_run_line = shell_line(resil_run(*opts, local=False, spares=spares, nproc_per_node=1, worker=worker))
        # node_logs: each node's srun output straight to tmp/step-<node>.out, written by that node's
        # slurmstepd, so it survives the batch host (where srun runs)
        logs = f"export SLURM_STDOUTMODE={tmp}/step-%N.out" if node_logs else ""
        script.write_text(f"""#!/bin/bash
#SBATCH -N {nodes}
#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH {"--requeue" if requeue else "--no-requeue"}
#SBATCH -t {minutes}
#SBATCH -o {tmp}/slurm.out
export RESILD_CONTROLLER_HOST=127.0.0.1
{logs}
{setup}
cd {where}
{resil_run_line} > {tmp}/summary.json
rc=$?
echo $rc > {tmp}/rc
{after}
exit $rc
""")
        self.jid = lab.run(["sbatch", "--parsable", str(script)]).stdout.strip().split(";")[0]

    def release(self) -> None:
        (self.tmp / f"release-{HOLD_STEP}").touch()

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
    # a test that failed half-way may leave its job running (tests here run one at a time)
    for jid in slurm_lab.run(["squeue", "-h", "-o", "%i"]).stdout.split():
        slurm_lab.run(["scancel", jid], check=False)
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
    job = Job(lab, tmp_path, held=True)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    t_fault = time.monotonic()
    lab.crash(victim)
    job.release()
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
    job = Job(lab, tmp_path, held=True)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.freeze(victim)
    job.release()
    job.wait_event(lambda e: e["event"] == "spare_assigned")
    lab.thaw(victim)  # it wakes up fenced: told to die, never rejoins
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    _equal(reference, job.final())
    (f,) = job.summary()["failures"]
    assert f["node"] == victim and "no heartbeat" in f["cause"]
    assert lab.sinfo_reasons().get(victim, "").startswith("resild: ")


def test_spares_exhausted_exits_nonzero_with_reason(lab: SlurmLab, tmp_path: Path) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, steps=100, held=True)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(victim)
    job.release()
    rc = job.wait()
    out = (tmp_path / "slurm.out").read_text()
    assert rc == 1, out
    assert f"resil-run: job failed: no spare left: {victim} failed" in out
    assert job.summary()["exit_code"] == 1


def test_two_jobs_at_once_do_not_interfere(lab: SlurmLab, tmp_path: Path) -> None:
    # 2 + 2 nodes of the 4-node lab, each job with its own embedded controller and store.
    a = Job(lab, tmp_path / "a", nodes=2, spares=0, steps=400, held=True)
    b = Job(lab, tmp_path / "b", nodes=2, spares=0, steps=400)
    a_victim = a.victim()
    b.active_nodes()
    a.wait_event(lambda e: e["event"] == "full_strength_step")
    b.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(a_victim)  # only job a loses a node (and, with no spare, fails cleanly)
    a.release()
    assert a.wait() == 1 and b.wait() == 0
    assert len(a.summary()["failures"]) == 1 and b.summary()["failures"] == []
    assert set(a.active_nodes()).isdisjoint(b.active_nodes())
    ea = a.wait_event(lambda e: e["event"] == "job_started")["endpoint"]
    eb = b.wait_event(lambda e: e["event"] == "job_started")["endpoint"]
    assert ea != eb


def test_requeue_on_exhaustion_puts_the_reason_in_the_comment(lab: SlurmLab, tmp_path: Path) -> None:
    job = Job(lab, tmp_path, nodes=2, spares=0, steps=400, extra="--requeue-on-exhaustion", held=True)
    victim = job.victim()
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    lab.crash(victim)
    job.release()
    job.wait_event(lambda e: e["event"] == "job_failed")
    deadline = time.monotonic() + 60
    info = ""
    while time.monotonic() < deadline:
        info = lab.run(["scontrol", "show", "job", "-o", job.jid]).stdout
        if "Restarts=1" in info and "Comment=resild: no spare left" in info:
            break
        time.sleep(0.3)
    lab.run(["scancel", job.jid], check=False)  # do not let the requeued job run again
    assert "Restarts=1" in info and f"Comment=resild: no spare left: {victim} failed" in info, (
        info,
        (tmp_path / "slurm.out").read_text()[-2000:],
    )


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


# ---- losing the batch host (the embedded controller) -------------------------------------------------
CONTROLLER_TIMEOUT_S = 5.0  # resil-run's default --controller-timeout
MARGIN_S = 3.0
_JOB_PROC = re.compile(r"launcher\.(node|cli)|resild\.replica|train\.py|slow_train")


def job_procs(lab: SlurmLab, node: str, tmp: Path) -> list[tuple[int, str]]:
    """This job's processes (resil-run, srun, node processes, workers) in a node's namespace:
    their command lines name the job's tmp dir (--events, --keys, --save)."""
    out = []
    for p in lab.pids(node):
        try:
            cl = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(tmp) in cl and _JOB_PROC.search(cl):
            out.append((p, cl[:120]))
    return out


def wait_no_job_procs(lab: SlurmLab, nodes: list[str], tmp: Path, t0: float, limit_s: float) -> float:
    while True:
        left = {n: job_procs(lab, n, tmp) for n in nodes}
        now = time.monotonic()
        if not any(left.values()):
            return now - t0
        if now - t0 > limit_s:
            raise AssertionError(f"job processes still alive {now - t0:.1f}s after the fault: {left}")
        time.sleep(0.1)


def show_job(lab: SlurmLab, jid: str) -> dict[str, str]:
    out = lab.run(["scontrol", "show", "job", "-o", jid]).stdout
    return dict(re.findall(r"\b(JobState|Reason|Restarts|NodeList|BatchHost|Requeue)=(\S+)", out))


def wait_job(lab: SlurmLab, jid: str, pred, timeout_s: float, what: str) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        info = show_job(lab, jid)
        if pred(info):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {jid}: {what} not seen in {timeout_s}s: {info}")
        time.sleep(0.2)


def job_comment(lab: SlurmLab, jid: str) -> str:
    m = re.search(r"\bComment=(.*?)(?= \w+=|$)", lab.run(["scontrol", "show", "job", "-o", jid]).stdout.strip())
    return m.group(1) if m else ""


def lease_lines(tmp: Path, node: str) -> list[str]:
    """The node process's lease line(s) in its step output (SLURM_STDOUTMODE): one at most."""
    p = tmp / f"step-{node}.out"
    return [ln for ln in p.read_text().splitlines() if "no word from the controller" in ln] if p.exists() else []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("requeue", [True, False], ids=["requeue", "no_requeue"])
def test_batch_host_crash_releases_the_job(lab: SlurmLab, tmp_path: Path, requeue: bool) -> None:
    """Slurm 22.05, --no-kill: a crashed batch host is cut out of the job like any other node, and
    Slurm would leave the job RUNNING without its batch script (no NODE_FAIL, no requeue, --requeue
    or not) until the time limit. The node processes' controller lease stops them within
    --controller-timeout, and they release the allocation (launcher/node/lease.py): scontrol requeue
    with the reason in the comment, or, when the job is not requeueable, scancel."""
    job = Job(lab, tmp_path, steps=100_000, requeue=requeue, minutes=5 if requeue else 2, node_logs=True)
    started = job.wait_event(lambda e: e["event"] == "job_started")
    host = started["controller_host"]
    others = [n for n in started["nodes"] if n != host]
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    assert all(job_procs(lab, n, tmp_path) for n in others)
    lab.crash(host)
    t0 = time.monotonic()  # node.sh kills at the end of its (slow) scan
    gone_s = wait_no_job_procs(lab, others, tmp_path, t0, CONTROLLER_TIMEOUT_S + MARGIN_S)
    lines = {n: lease_lines(tmp_path, n) for n in others}
    # ended by the lease (exit 75), at most one line each; Slurm's TERM after the first requeue/scancel
    # may end another node process before its own lease ran out (then it says nothing), and the step's
    # output may be torn down before a line is written (seen under load): the job's fate below proves
    # the lease acted.
    assert all(len(v) <= 1 for v in lines.values()), lines
    said = [v[0] for v in lines.values() if v]
    assert all("exit 75" in ln for ln in said), said

    if requeue:
        info = wait_job(
            lab,
            job.jid,
            lambda i: i["Restarts"] == "1" and i["JobState"] in ("PENDING", "RUNNING"),
            CONTROLLER_TIMEOUT_S + 30,
            "requeued",
        )
        end_s = time.monotonic() - t0
        comment = job_comment(lab, job.jid)
        lab.run(["scancel", job.jid], check=False)  # do not let the requeued job run again
        assert comment.startswith("resild: controller lost (no word from tcp://") and "batch host down?" in comment, (
            comment
        )
        assert not said or any("requeued Slurm job " + job.jid in ln for ln in said), said
        assert not any("cancel" in ln for ln in said), said
        end = f"requeued ({info['JobState']}, Reason={info['Reason']}) after {end_s:.1f}s"
    else:
        info = wait_job(lab, job.jid, lambda i: i["JobState"] == "CANCELLED", CONTROLLER_TIMEOUT_S + 30, "CANCELLED")
        end_s = time.monotonic() - t0
        assert info["Restarts"] == "0", info
        assert not said or any(
            "Requested operation is presently disabled" in ln and "cancelled it" in ln for ln in said
        ), said
        end = f"CANCELLED after {end_s:.1f}s (time limit 120 s)"
    assert end_s < 60, end
    assert not (tmp_path / "rc").exists()  # the batch script never got past resil-run
    print(f"\nbatch host crash: node processes gone after {gone_s:.1f}s (lease), job {end}", *said, sep="\n  ")


@pytest.mark.timeout(120)
def test_controller_killed_node_processes_exit_on_the_lease(lab: SlurmLab, tmp_path: Path) -> None:
    """SIGKILL resil-run (the controller) on the batch host. The batch script lives on (it sleeps
    after resil-run, as a script copying results would), so Slurm ends nothing: the lease alone
    must stop every node process and worker, on every node, spare included. They cannot tell a
    dead controller from a dead batch host, so they requeue the job the same way."""
    job = Job(lab, tmp_path, steps=100_000, node_logs=True, after="sleep 60")
    started = job.wait_event(lambda e: e["event"] == "job_started")
    host, nodes = started["controller_host"], started["nodes"]
    job.wait_event(lambda e: e["event"] == "full_strength_step")
    assert all(job_procs(lab, n, tmp_path) for n in nodes), {n: job_procs(lab, n, tmp_path) for n in nodes}
    (controller,) = [p for p, cl in job_procs(lab, host, tmp_path) if "launcher.run.cli" in cl]
    os.kill(controller, signal.SIGKILL)
    t0 = time.monotonic()
    gone_s = wait_no_job_procs(lab, nodes, tmp_path, t0, CONTROLLER_TIMEOUT_S + MARGIN_S)
    assert job.wait(10) == 128 + signal.SIGKILL
    lines = {n: lease_lines(tmp_path, n) for n in nodes}
    assert all(len(v) <= 1 for v in lines.values()) and any(lines.values()), lines
    said = [v[0] for v in lines.values() if v]
    assert all("exit 75" in ln for ln in said), said
    assert any("requeued Slurm job " + job.jid in ln for ln in said), said
    info = wait_job(
        lab, job.jid, lambda i: i["Restarts"] == "1" and i["JobState"] in ("PENDING", "RUNNING"), 30, "requeued"
    )
    end_s = time.monotonic() - t0
    comment = job_comment(lab, job.jid)
    lab.run(["scancel", job.jid], check=False)
    assert comment.startswith("resild: controller lost (no word from tcp://"), comment
    print(
        f"\ncontroller SIGKILLed: every node process and worker gone after {gone_s:.1f}s, job requeued "
        f"({info['JobState']}) after {end_s:.1f}s",
        *said,
        sep="\n  ",
    )


@pytest.mark.timeout(120)
def test_node_crash_before_the_first_step_is_replaced_by_the_spare(lab: SlurmLab, tmp_path: Path) -> None:
    # workers start 4 s late, so the node dies after it registered and before the first epoch
    slow = tmp_path / "slow_train.sh"
    slow.write_text(f'#!/bin/bash\nsleep 4\nexec {sys.executable} {REPO}/examples/train.py "$@"\n')
    slow.chmod(0o755)
    job = Job(lab, tmp_path, train=str(slow), steps=60)
    host = job.wait_event(lambda e: e["event"] == "job_started")["controller_host"]
    roles: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(roles) < 3 and time.monotonic() < deadline:
        roles = {e["node"]: e["role"] for e in job.events() if e["event"] == "node_registered"}
        time.sleep(0.05)
    victim = next(n for n, r in sorted(roles.items()) if r == "active" and n != host)
    (spare,) = [n for n, r in roles.items() if r == "spare"]
    assert not any(e["event"] in ("membership", "worker_registered") for e in job.events())
    lab.crash(victim)
    assigned = job.wait_event(lambda e: e["event"] == "spare_assigned")
    assert job.wait() == 0, (tmp_path / "slurm.out").read_text()[-3000:]
    first = job.wait_event(lambda e: e["event"] == "membership")
    assert set(first["layout"]) == {host, spare}, first  # the first epoch already runs on the spare
    assert all(len(ranks) == 1 for ranks in first["layout"].values())
    assert job.final()["step"] == 60
    (f,) = job.summary()["failures"]
    assert f["node"] == victim, f
    print(f"\nstart-up crash of {victim}: {assigned}")
