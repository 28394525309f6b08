"""`resil-run --local --readmit`: a node fenced on suspicion comes back as a spare, qualified
first, and later takes a failed node's ranks; a node fenced with evidence never comes back."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from bench.commands import resil_run
from tests.launcher.run.conftest import REPO, RunResult, assert_bitwise_equal, start_job
from tests.launcher.run.test_join import _events, _wait

pytestmark = pytest.mark.timeout(300)
QUIET_S = 3 * 2.0  # policy.readmit_quiet_s: 3 heartbeat timeouts (resil-run's default 2 s)


def test_a_suspect_node_comes_back_and_takes_ranks_and_one_with_an_xid_never_does(
    tmp_path: Path, reference: RunResult
) -> None:
    held = f"{REPO}/tests/held_train.py {tmp_path}/release 15,30"
    job = start_job(
        tmp_path,
        "--readmit",
        "--hang-timeout",
        "60",
        "--inject",
        "exception:node0@10",  # a worker raises: fenced on suspicion, not drained
        "--inject",
        "xid79:node1@20",  # evidence against the GPU: drained
        script=held,
    )
    try:
        back = _wait(job, lambda e: e["event"] == "node_readmitted", "local-node0 back", timeout_s=120)
        assert back["node"] == "local-node0" and "fenced without evidence" in back["reason"], back
        # its new node process qualified (no worker before that) and warmed up as a spare
        _wait(
            job,
            lambda e: e["event"] == "worker_registered" and e["node"] == "local-node0" and e["t_mono"] > back["t_mono"],
            "local-node0 warm again",
        )
        Path(f"{tmp_path}/release-15").touch()
        took = _wait(job, lambda e: e["event"] == "spare_assigned" and e["failed"] == "local-node1", "xid79 replaced")
        assert took["spare"] == "local-node0", took
        fenced = _wait(job, lambda e: e["event"] == "node_fenced" and e["node"] == "local-node1", "node1 fenced")
        assert fenced["drained"]
        time.sleep(QUIET_S + 2.0)  # long enough for a suspect to have come back
        assert not any(e["event"] == "node_readmitted" and e["node"] == "local-node1" for e in _events(job))
        Path(f"{tmp_path}/release-30").touch()
        r = job.finish(timeout_s=180)
    finally:
        for hold in (15, 30):
            Path(f"{tmp_path}/release-{hold}").touch()
        if job.p.poll() is None:
            job.p.kill()
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    assigned = [(e["failed"], e["spare"]) for e in r.events if e["event"] == "spare_assigned"]
    assert assigned == [("local-node0", "local-node2"), ("local-node1", "local-node0")], assigned
    assert [e["node"] for e in r.events if e["event"] == "node_readmitted"] == ["local-node0"]
    journal = [json.loads(x) for x in (tmp_path / "run" / "journal.jsonl").read_text().splitlines()]
    assert [j["node"] for j in journal if j["action"] == "readmit"] == ["local-node0"]
    assert "local-node0 is back as a hot spare" in r.stderr


def test_readmit_needs_one_controller(tmp_path: Path) -> None:
    """Slurm is fine now (a new step on the node: tests/slurm); standby controllers are not."""
    p = subprocess.run(
        resil_run("--readmit", "--controllers", "3", worker=["python", "x.py"]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "--readmit runs with one controller" in p.stderr and "Traceback" not in p.stderr
