"""The control plane's own failures, end to end with real processes: the controller
frozen or killed (the lease), a node lost during start-up (a spare takes its place).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch

from bench.commands import resil_run, train
from resild.controller.etcd_client import Etcd
from resild.controller.etcd_cluster import LocalEtcd
from resild.controller.etcd_journal import read_records
from tests.etcdlab.fixture import ensure_etcd, etcd_cluster  # noqa: F401 (fixture)

from .conftest import REPO, STEPS, TRAIN, RunResult, _marked, assert_bitwise_equal, run_job

pytestmark = pytest.mark.timeout(180)


class LiveJob:
    """resil-run started in the background, so a test can act on it while it runs."""

    def __init__(
        self,
        tmp: Path,
        *args: str,
        nodes: int = 3,
        spares: int = 1,
        steps: int = STEPS,
        script: Path = TRAIN,
        quiet: bool = True,
    ) -> None:
        self.mark = uuid.uuid4().hex
        tmp.mkdir(parents=True, exist_ok=True)
        self.ev, self.save = tmp / "events.jsonl", tmp / "final.pt"
        cmd = resil_run(
            "--events",
            str(self.ev),
            "--run-dir",
            str(tmp / "run"),
            "--json",
            *(["-q"] if quiet else []),
            *args,
            nodes=nodes,
            spares=spares,
            worker=train(steps, self.save, script),
        )
        env = dict(os.environ, RESILD_TEST_MARK=self.mark, PYTHONUNBUFFERED="1")
        self.err = open(tmp / "stderr.txt", "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def events(self) -> list[dict]:
        if not self.ev.exists():
            return []
        out = []
        for line in self.ev.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # being written
        return out

    def wait_event(self, pred: Callable[[dict], bool], timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for e in self.events():
                if pred(e):
                    return e
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"event not seen; stderr: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return Path(self.err.name).read_text()

    def finish(self, timeout_s: float = 120.0) -> RunResult:
        out, _ = self.proc.communicate(timeout=timeout_s)
        self.err.close()
        try:
            summary = json.loads(out)
        except ValueError:
            summary = None
        final = torch.load(self.save) if self.save.exists() else None
        return RunResult(self.proc.returncode, out, self.stderr(), self.events(), summary, final)

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        left = _marked(self.mark)
        for p in left:
            p.kill()
        assert not left, f"orphans: {[(p.pid, p.name()) for p in left]}"


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_frozen_controller_leaves_no_process_behind(tmp_path: Path) -> None:
    # the lease (2 s) must exceed the node-loss timeout: the settings nest
    job = LiveJob(tmp_path, "--heartbeat-timeout", "1.5", "--controller-timeout", "2", steps=100000)
    try:
        job.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 3, timeout_s=90)

        def registered() -> set[int]:
            return {e["pid"] for e in job.events() if e["event"] in ("node_registered", "worker_registered")}

        # 3 node processes (the spare's included) and their 3 workers; on a loaded machine the
        # spare's worker may register after training started
        deadline = time.monotonic() + 60
        while len(pids := registered()) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(pids) == 6, pids
        t0 = time.monotonic()
        job.proc.send_signal(signal.SIGSTOP)  # the controller is frozen: nothing it could do
        while not all(_gone(p) for p in pids) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        took_s = time.monotonic() - t0
        assert all(_gone(p) for p in pids), f"alive after {took_s:.1f}s: {[p for p in pids if not _gone(p)]}"
        assert 1.5 < took_s < 6.0, took_s  # the 2 s lease (+ the lease check's own slack), not sooner
        job.proc.send_signal(signal.SIGCONT)
        job.proc.kill()
        job.proc.wait()
        lines = [ln for ln in job.stderr().splitlines() if "no word from the controller" in ln]
        assert len(lines) == 3, job.stderr()[-3000:]  # one line per node process, naming the controller
        assert all("tcp://127.0.0.1:" in ln and "exit 75" in ln for ln in lines), lines
    finally:
        job.cleanup()


def test_a_node_lost_during_start_up_is_replaced_by_a_spare(tmp_path: Path, reference: RunResult) -> None:
    job = LiveJob(tmp_path)
    try:
        reg = job.wait_event(lambda e: e["event"] == "node_registered" and e["node"] == "local-node0")
        # Its workers are still importing torch: nobody has registered a rank yet.
        assert not [e for e in job.events() if e["event"] == "membership"]
        os.kill(reg["pid"], signal.SIGKILL)
        r = job.finish()
    finally:
        job.cleanup()
    assert r.rc == 0, r.stderr[-3000:]
    (sa,) = [e for e in r.events if e["event"] == "spare_assigned"]
    assert sa["failed"] == "local-node0" and sa["spare"] == "local-node2" and sa["before_start"]
    (m,) = [e for e in r.events if e["event"] == "membership"]  # one epoch: the job started at full strength
    assert m["epoch"] == 1 and set(m["layout"]) == {"local-node1", "local-node2"}
    assert_bitwise_equal(reference.final, r.final)


def test_killing_the_leader_controller_loses_nothing(tmp_path: Path) -> None:
    ensure_etcd()  # the replicas' etcd cluster
    # Three controller replicas (etcd). The leader is SIGKILLed mid-job; a standby takes
    # over from the replicated journal, and it is the one that handles the node fault
    # injected later: the job ends bitwise identical, no committed step lost.
    steps = 300  # ~25 ms steps here: the takeover (~1 s) ends long before the fault at 250
    ref = run_job(tmp_path / "ref", steps=steps)
    assert ref.rc == 0, ref.stderr[-2000:]
    job = LiveJob(tmp_path / "hurt", "--controllers", "3", "--inject", "kill:node1@250", steps=steps, quiet=False)
    try:
        first = job.wait_event(lambda e: e["event"] == "controller_leader", timeout_s=90)
        job.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 20, timeout_s=90)
        os.kill(first["pid"], signal.SIGKILL)
        t_kill = time.monotonic()
        second = job.wait_event(lambda e: e["event"] == "controller_leader" and e["pid"] != first["pid"])
        r = job.finish()
    finally:
        job.cleanup()
    assert r.rc == 0, r.stderr[-3000:]
    assert second["term"] > first["term"] and second["restored"] >= 1
    assert second["t_mono"] - t_kill < 3.0, second["t_mono"] - t_kill
    fs = r.summary["failures"]
    assert len(fs) == 1 and fs[0]["steps_lost"] == 0, fs
    (sa,) = [e for e in r.events if e["event"] == "spare_assigned"]
    assert sa["t_mono"] > second["t_mono"]  # decided by the new leader
    assert r.final["step"] == ref.final["step"] == steps
    assert all(torch.equal(v, r.final["model"][k]) for k, v in ref.final["model"].items())
    # The old leader's death made one new leader; the job's end made none (the last leader
    # stands the standbys down), and the summary's step time is the reference's, not skew.
    assert [e["pid"] for e in r.events if e["event"] == "controller_leader"] == [first["pid"], second["pid"]]
    assert f"controller replica {first['index']} lost; replica {second['index']} leads now" in r.stderr, r.stderr[
        -2000:
    ]
    assert "back at full strength" in r.stderr and "raft" not in r.stderr  # Raft's chatter is in the replica logs
    assert 0.5 < r.summary["job"]["step_s"] / ref.summary["job"]["step_s"] < 2.0, (r.summary, ref.summary)
    # No worker restarted: the survivors registered again with the new leader, same pids.
    pids = {e["pid"] for e in r.events if e["event"] == "worker_registered"}
    assert len(pids) == 3, pids


def test_two_leader_changes_in_a_row_and_a_deposed_leader_stands_by(tmp_path: Path) -> None:
    ensure_etcd()  # the replicas' etcd cluster
    # etcd: the leader is frozen past its lease (a standby leads), thawed (it finds itself
    # deposed and stands by again, it does not exit), then the new leader is killed: a
    # third leadership (maybe the thawed replica's) finishes the job with nothing lost.
    steps = 700
    job = LiveJob(tmp_path, "--controllers", "3", steps=steps)
    try:
        first = job.wait_event(lambda e: e["event"] == "controller_leader", timeout_s=90)
        job.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 20, timeout_s=90)
        os.kill(first["pid"], signal.SIGSTOP)
        second = job.wait_event(lambda e: e["event"] == "controller_leader" and e["pid"] != first["pid"])
        os.kill(first["pid"], signal.SIGCONT)
        log = tmp_path / "run" / f"replica-{first['index']}.log"
        deadline = time.monotonic() + 10
        while "deposed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "deposed" in log.read_text() and not _gone(first["pid"]), log.read_text()[-2000:]
        job.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 100 and e["t_mono"] > second["t_mono"])
        os.kill(second["pid"], signal.SIGKILL)
        third = job.wait_event(
            lambda e: e["event"] == "controller_leader" and e["t_mono"] > second["t_mono"] and e["pid"] != second["pid"]
        )
        r = job.finish()
    finally:
        job.cleanup()
    assert r.rc == 0, r.stderr[-3000:]
    assert first["term"] < second["term"] < third["term"], (first, second, third)
    assert third["restored"] >= second["restored"] >= 1
    assert r.final is not None and r.final["step"] == steps
    assert all(f["steps_lost"] == 0 for f in r.summary["failures"]), r.summary["failures"]
    leaders = [e["pid"] for e in r.events if e["event"] == "controller_leader"]
    assert leaders == [first["pid"], second["pid"], third["pid"]], leaders
    # every replica still running at the end was stood down by the last leader's `closed`
    for i in {first["index"], third["index"]} | ({0, 1, 2} - {second["index"]}):
        last = json.loads((tmp_path / "run" / f"journal-{i}.jsonl").read_text().splitlines()[-1])
        assert last["action"] == "closed", (i, last)


@pytest.mark.timeout(300)
def test_a_job_resumed_from_its_etcd_keeps_its_fenced_nodes_and_fired_faults(tmp_path: Path) -> None:
    # resil-run is killed mid-job (its replicas and etcd die with it, the nodes on their
    # lease); `--resume RUN_DIR` restarts the job's etcd on its data: the new leader starts
    # the job again from the journal: the node lost before stays fenced, its fault does not
    # fire again, and the workers continue from the checkpoint.
    ensure_etcd()
    steps = 600
    args = ("--controllers", "3", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "50")
    job = LiveJob(tmp_path, *args, "--inject", "kill:node1@100", steps=steps)
    try:
        job.wait_event(lambda e: e["event"] == "spare_assigned", timeout_s=120)
        job.wait_event(lambda e: e["event"] == "progress" and e["step"] >= 220, timeout_s=120)
        job.proc.kill()  # resil-run, as its host would die
        job.proc.wait()
        deadline = time.monotonic() + 20  # the replicas and etcd at once, the nodes on their 5 s lease
        while _marked(job.mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(job.mark), [(p.pid, p.name()) for p in _marked(job.mark)]
        assert not job.save.exists()
    finally:
        job.cleanup()
    t_resume = time.monotonic()
    again = LiveJob(tmp_path, *args, "--resume", str(tmp_path / "run"), "--inject", "kill:node1@100", steps=steps)
    try:
        r = again.finish(timeout_s=200)
    finally:
        again.cleanup()
    assert r.rc == 0, r.stderr[-3000:]
    assert "resuming the job of" in r.stderr
    events = [e for e in r.events if e["t_mono"] > t_resume]
    (restored,) = [e for e in events if e["event"] == "controller_restored"]
    assert restored["fenced"] == ["local-node1"] and restored["records"] >= 3
    assert not [e for e in events if e["event"] in ("fault_injected", "spare_assigned")], events
    (start,) = [e for e in events if e["event"] == "membership"][:1]
    assert "local-node1" not in json.dumps(start), start
    assert r.final is not None and r.final["step"] == steps
    assert "loaded checkpoint step" in r.stderr
    # A finished job is not run again: its verdict is said again.
    never = [sys.executable, "-c", "raise SystemExit(3)"]
    over = subprocess.run(
        resil_run("--controllers", "3", "--resume", str(tmp_path / "run"), worker=never),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert over.returncode == 0 and "is over (exit 0" in over.stderr, over.stderr[-2000:]
    # the finished job's etcd data is gone (outside the run directory, where nothing else removes it)
    assert not Path(json.loads((tmp_path / "run" / "etcd" / "cluster.json").read_text())["data"]).exists()


def test_standby_controllers_on_a_site_etcd(tmp_path: Path, etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    # --etcd: the job's keys go under its prefix in the site's etcd (TLS with the given
    # files); resil-run starts no etcd of its own.
    site = etcd_cluster.target()
    assert site.ca and site.cert and site.key
    tls = ("--etcd-ca", site.ca, "--etcd-cert", site.cert, "--etcd-key", site.key)
    job = LiveJob(
        tmp_path / "job",
        "--controllers",
        "3",
        "--etcd",
        ",".join(site.endpoints),
        *tls,
        "--etcd-prefix",
        "/site/a",
        steps=40,
    )
    try:
        r = job.finish()
    finally:
        job.cleanup()
    assert r.rc == 0, r.stderr[-3000:]
    assert not (tmp_path / "job" / "run" / "etcd").exists()
    records = [rec["action"] for _, rec in read_records(Etcd(site), "/site/a")]
    assert records[0] == "leader" and "start" in records and records[-1] == "closed", records
    assert all(p.poll() is None for p in etcd_cluster.procs.values())  # the site's etcd is not the job's to stop


def test_the_last_leader_stands_the_standbys_down(tmp_path: Path) -> None:
    ensure_etcd()  # the replicas' etcd cluster
    # Without `closed` the two standbys elect a leader for the finished job the moment the
    # last leader exits (it said the verdict again, late, and skewed the summary).
    job = LiveJob(tmp_path, "--controllers", "3", steps=40)
    try:
        job.wait_event(lambda e: e["event"] == "controller_leader", timeout_s=90)
        # The job's etcd members (client and peer ports) listen where the replicas are
        # (loopback in --local), not on every interface (issue 18, finding 2).
        members = json.loads((tmp_path / "run" / "etcd" / "cluster.json").read_text())["members"]
        ports = {m[k] for m in members for k in ("client_port", "peer_port")}
        assert len(ports) == 6
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
        }
        r = job.finish()
    finally:
        job.cleanup()
    assert listening == {("127.0.0.1", p) for p in ports}, listening
    assert r.rc == 0, r.stderr[-3000:]
    assert len([e for e in r.events if e["event"] == "controller_leader"]) == 1, r.events[-5:]
    for i in range(3):
        last = json.loads((tmp_path / "run" / f"journal-{i}.jsonl").read_text().splitlines()[-1])
        assert last["action"] == "closed", (i, last)
    assert not _etcd_left(tmp_path / "run")  # the job's etcd went with it


def _etcd_left(run_dir: Path) -> list[int]:
    """etcd members of this run still running (their data directory is under it)."""
    return [
        p.pid
        for p in psutil.process_iter(["name", "cmdline"])
        if p.info["name"] == "etcd" and str(run_dir) in " ".join(p.info["cmdline"] or [])
    ]
