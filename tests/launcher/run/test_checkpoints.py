"""End to end: disk checkpoints that fail, hang or outlive a recovery never stall training
(issue 41). The storage writer is DCP's own with faults injected at its planning, data,
metadata and COMPLETE points (launcher.worker.checkpoint_faults); every job must end
bitwise identical to the failure-free reference, with what happened to its checkpoints
in the events and the summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.worker.checkpoint_faults import ENV
from launcher.worker.disk_checkpoint import complete_steps

from .conftest import RunResult, assert_bitwise_equal, run_job

pytestmark = pytest.mark.timeout(240)


def _job(tmp: Path, faults: str, *inject: str) -> RunResult:
    args = ("--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "10", *inject)
    return run_job(tmp, *args, env={ENV: faults})


def _ck(r: RunResult, name: str) -> list[dict]:
    return [e for e in r.events if e["event"] == f"checkpoint_{name}"]


def test_a_checkpoint_failing_at_every_point_is_reported_and_the_next_cadence_saves(
    tmp_path: Path, reference: RunResult
) -> None:
    faults = "plan:fail@10,write:fail@20:r1,finish:fail@30,complete:fail@40"
    r = _job(tmp_path, faults)
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    failed = _ck(r, "failed")
    assert [(e["step"], e["abandoned"]) for e in failed] == [(s, False) for s in (10, 20, 30, 40)], failed
    assert "injected checkpoint fault plan:fail@10" in failed[0]["error"]
    assert "injected checkpoint fault write:fail@20" in failed[1]["error"]
    assert "did not mark it complete" in failed[3]["error"]
    assert [e["step"] for e in _ck(r, "saved")] == [50, 60]
    assert complete_steps(tmp_path / "ck") == [50, 60]
    assert r.summary is not None
    counts = r.summary["job"]["checkpoints"]
    assert (counts["saved"], counts["failed"], counts["abandoned"]) == (2, 4, 0), counts
    assert counts["last_saved_step"] == 60


def test_a_checkpoint_still_writing_across_a_recovery_is_abandoned_and_never_meets_the_new_epoch(
    tmp_path: Path, reference: RunResult
) -> None:
    # Issue 41: rank 0's save of step 20 is still writing when node1 is lost; it goes on
    # once the recovery has formed the checkpoint group again. Its later collectives must
    # not pair with the new epoch's (they fed a peer's unpickling an empty buffer, and
    # rank 0's next save waited on it forever: fenced as hung, the job lost).
    r = _job(tmp_path, "write:outlive@20:r0", "--inject", "kill:node1@22")
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    assert [e for e in r.events if e["event"] == "state_replayed"], "no recovery ran"
    failed = _ck(r, "failed")
    assert [(e["step"], e["abandoned"]) for e in failed] == [(20, True)], failed
    saved = [e["step"] for e in _ck(r, "saved")]
    assert saved[-2:] == [50, 60] and 20 not in saved, saved
    assert complete_steps(tmp_path / "ck") == [50, 60]
    assert r.summary is not None and r.summary["job"]["checkpoints"]["abandoned"] == 1


def test_a_hung_checkpoint_defers_the_next_ones_and_never_stalls_training(tmp_path: Path, reference: RunResult) -> None:
    # rank 1's file server never answers from step 20 on (rank 0 waits for it in DCP's gather):
    # every later due save is deferred
    # (the vote says a rank is still writing), training goes on, and the end of the job
    # waits a bounded time for the save before it says it never finished.
    r = _job(tmp_path, "write:hang@20:r1")
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    (deferred,) = _ck(r, "deferred")
    assert deferred["step"] == 30 and "2 rank(s) still writing" in deferred["reason"], deferred
    failed = _ck(r, "failed")
    assert [e["step"] for e in failed] == [20] and "did not finish within" in failed[0]["error"], failed
    assert [e["step"] for e in _ck(r, "saved")] == [10]
    assert complete_steps(tmp_path / "ck") == [10]
    assert r.summary is not None
    counts = r.summary["job"]["checkpoints"]
    assert (counts["saved"], counts["failed"], counts["deferred"]) == (1, 1, 1), counts
