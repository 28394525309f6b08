"""End to end: real resil-run, node processes, workers, ZeroMQ and gloo on loopback.

Every recovered run must end bitwise identical to the failure-free reference,
lose no committed step, keep healthy workers' PIDs, and leave no process behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import REPO, RunResult, assert_bitwise_equal, run_job

DROPOUT = Path(__file__).with_name("train_dropout.py")

pytestmark = pytest.mark.timeout(240)


def failures(r: RunResult) -> list[dict]:
    assert r.summary is not None, r.stderr
    return r.summary["failures"]


def check_recovered(r: RunResult, reference: RunResult, n_failures: int) -> list[dict]:
    assert r.rc == 0, r.stderr[-3000:]
    fs = failures(r)
    assert len(fs) == n_failures, fs
    for f in fs:
        assert f["steps_lost"] == 0, f
        assert f["recovery_s"] is not None and f["bytes_replayed"] > 0, f
    assert_bitwise_equal(reference.final, r.final)
    replays = [e for e in r.events if e["event"] == "state_replayed"]
    assert replays and all(e["authenticated"] for e in replays), replays  # tagged under the job's data key
    # Healthy workers never restarted: one registration per (node, local rank) and
    # the PIDs that finished are the ones that registered.
    regs: dict[tuple[str, int], list[int]] = {}
    for e in r.events:
        if e["event"] == "worker_registered":
            regs.setdefault((e["node"], e["local_rank"]), []).append(e["pid"])
    assert all(len(p) == 1 for p in regs.values()), regs
    fenced = {e["node"] for e in r.events if e["event"] == "node_fenced"}
    done_pids = {e["pid"] for e in r.events if e["event"] == "rank_done"}
    survivors = {p[0] for (node, _), p in regs.items() if node not in fenced}
    assert survivors & done_pids, "no surviving worker finished the job"
    assert not ({p[0] for (node, _), p in regs.items() if node in fenced} & done_pids), "a fenced worker came back"
    return fs


@pytest.mark.parametrize(
    "fault,detector",
    [
        ("kill:node1@20", "process-exit"),
        ("exception:node0@20", "exception"),
        ("hang:node1@20", "hang"),
        ("nodeloss:node0@20", "process-exit"),
        ("xid79:node1@20", "nvml-xid"),  # GPU fell off the bus, through the NVML stand-in and real pynvml
        ("xid48:node0@20", "nvml-xid"),  # double-bit ECC
    ],
)
def test_single_fault_is_survived_bitwise(tmp_path: Path, reference: RunResult, fault: str, detector: str) -> None:
    r = run_job(tmp_path, "--inject", fault, "--hang-timeout", "2")
    (f,) = check_recovered(r, reference, 1)
    assert f["detector"] == detector
    assert f["fault"].startswith(fault.split(":")[0])


def test_a_slow_abort_of_the_old_communicator_is_off_the_critical_path(tmp_path: Path, reference: RunResult) -> None:
    # Every old backend's abort takes 30 s more (as NCCL's takes ~1 s): the survivors form the
    # new group and the spare takes over meanwhile; nothing waits for a gloo abort (no late
    # writer to fence, launcher/worker/old_backends.py), so the recovery is not 30 s long.
    r = run_job(tmp_path, "--inject", "kill:node1@20", env={"RESILD_ABORT_DELAY_S": "30"})
    (f,) = check_recovered(r, reference, 1)
    assert f["recovery_s"] < 20, f
    formed = [e for e in r.events if e["event"] == "group_reformed" and e.get("epoch", 0) > 1]
    assert formed and all(e["abort_wait_s"] == 0 for e in formed), formed


def test_two_faults_in_sequence_with_two_spares(tmp_path: Path, reference: RunResult) -> None:
    r = run_job(tmp_path, "--inject", "kill:node0@15", "--inject", "nodeloss:node1@35", nodes=4, spares=2)
    fs = check_recovered(r, reference, 2)
    assert [f["node"] for f in fs] == ["local-node0", "local-node1"]


def test_fault_during_recovery_restarts_recovery_at_a_higher_epoch(tmp_path: Path, reference: RunResult) -> None:
    # node2 is the first spare: it dies the moment it is handed node0's ranks.
    r = run_job(tmp_path, "--inject", "kill:node0@20", "--inject", "kill:node2@e2", nodes=4, spares=2)
    assert r.rc == 0, r.stderr[-3000:]
    fs = failures(r)
    assert [f["node"] for f in fs] == ["local-node0", "local-node2"]
    assert_bitwise_equal(reference.final, r.final)
    epochs = [e["epoch"] for e in r.events if e["event"] == "membership"]
    assert epochs == [1, 2, 3]
    full = [e["epoch"] for e in r.events if e["event"] == "full_strength_step"]
    assert 2 not in full and 3 in full  # epoch 2 never trained: the failure hit its recovery


def test_no_spare_left_fails_cleanly_with_one_line(tmp_path: Path) -> None:
    r = run_job(tmp_path, "--inject", "kill:node1@10", nodes=2, spares=0, timeout_s=60)
    assert r.rc == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert (
        lines == [f"resil-run: job failed: no spare left: local-node1 failed ({lines[0].split('(', 1)[1]}"]
        and "signal" in lines[0]
    )
    assert r.final is None


def test_bad_fault_spec_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    r = run_job(tmp_path, "--inject", "explode:node1@3", timeout_s=30)
    assert r.rc == 2 and "unknown fault kind" in r.stderr and "Traceback" not in r.stderr
    r = run_job(tmp_path, "--inject", "kill:node9@3", timeout_s=30)
    assert r.rc == 2 and "nodes are local-node0" in r.stderr


def test_the_same_exception_twice_is_a_bug_not_a_fault(tmp_path: Path) -> None:
    # The first exception uses a spare; the same error on the replacement stops the job
    # instead of burning the second spare on what is evidently a software bug.
    r = run_job(tmp_path, "--inject", "exception:node0@15", "--inject", "exception:node2@30", nodes=4, spares=2)
    assert r.rc == 1, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert "bug in the training script" in line and "RuntimeError: resild fault injection" in line
    assert [e["spare"] for e in r.events if e["event"] == "spare_assigned"] == ["local-node2"]


def test_rng_and_data_cursor_are_rewound_and_replayed(tmp_path: Path) -> None:
    ref = run_job(tmp_path / "ref", script=DROPOUT)
    assert ref.rc == 0, ref.stderr[-2000:]
    r = run_job(tmp_path / "hurt", "--inject", "kill:node1@20", script=DROPOUT)
    assert r.rc == 0, r.stderr[-2000:]
    assert len(failures(r)) == 1
    assert_bitwise_equal(ref.final, r.final)
    assert r.final["cursor"] == ref.final["cursor"] == 60
    assert torch.equal(r.final["rng"], ref.final["rng"])


def test_a_bad_command_fails_the_job_in_one_line_without_using_spares(tmp_path: Path) -> None:
    r = run_job(tmp_path, nodes=3, spares=1, timeout_s=60, script=tmp_path / "missing.py")
    assert r.rc == 1
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert "before the job started" in line and "exited with code 2" in line
    assert not [e for e in r.events if e["event"] == "spare_assigned"]


def test_losing_the_last_holder_during_a_recovery_stops_instead_of_restarting_from_zero(tmp_path: Path) -> None:
    # node0 dies at step 20; node1, the only rank left holding the state, dies the
    # moment epoch 2 is announced. The two spares hold nothing: the job must stop.
    r = run_job(tmp_path, "--inject", "kill:node0@20", "--inject", "kill:node1@e2", nodes=4, spares=2, timeout_s=90)
    assert r.rc != 0, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert "every rank holding committed step" in line and "checkpointless recovery is impossible" in line, line
    assert r.final is None


def test_a_collective_failure_with_every_node_alive_reforms_the_same_nodes(
    tmp_path: Path, reference: RunResult
) -> None:
    """A rank's data-plane connections reset (every process alive): the controller probes,
    every node answers, and the group is re-formed on the same nodes (Action.REFORM, the
    path a stall with no culprit now takes too): no spare spent, the result bitwise."""
    r = run_job(tmp_path, script=f"{REPO}/tests/reset_train.py 10 1")
    assert r.rc == 0, r.stderr[-3000:]
    assert "cut " in r.stderr and "connections at step 10" in r.stderr
    assert_bitwise_equal(reference.final, r.final)
    reforms = [e for e in r.events if e["event"] == "reform"]
    assert reforms and "every node answered the liveness probe" in reforms[0]["reason"], reforms
    assert not [e for e in r.events if e["event"] in ("spare_assigned", "node_fenced")]
