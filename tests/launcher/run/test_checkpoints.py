"""End to end: disk checkpoints that fail, hang or outlive a recovery never stall training
(issue 41). The storage writer is DCP's own with faults injected at its planning, data,
metadata and COMPLETE points (launcher.worker.redundancy.checkpoint_faults); every job must end
bitwise identical to the failure-free reference, with what happened to its checkpoints
in the events and the summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.worker.redundancy.checkpoint_faults import ENV
from launcher.worker.redundancy.disk_checkpoint import complete_steps

from .conftest import RunResult, assert_bitwise_equal, run_job

pytestmark = pytest.mark.timeout(240)


def _job(tmp: Path, faults: str, *inject: str) -> RunResult:
    args = ("--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "10", *inject)
    return run_job(tmp, *args, env={ENV: faults})


def _ck(r: RunResult, name: str) -> list[dict]:
    return [e for e in r.events if e["event"] == f"checkpoint_{name}"]


def _steps(events: list[dict]) -> list[int]:
    return [e["step"] for e in events]


def test_a_checkpoint_failing_at_every_point_is_reported_and_the_next_cadence_saves(
    tmp_path: Path, reference: RunResult
) -> None:
    # Each fault hits the first save at or after its step (a save deferred by a slow one
    # before it still meets its fault): four saves fail in turn, the later ones complete.
    faults = "plan:fail@10,write:fail@20:r1,finish:fail@30,complete:fail@40"
    r = _job(tmp_path, faults)
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    failed = _ck(r, "failed")
    assert [e["abandoned"] for e in failed] == [False] * 4, failed
    for e, (want, at) in zip(failed, [("plan:fail@10", 10), ("write:fail@20", 20), ("finish:fail@30", 30), ("", 40)]):
        assert want in e["error"] and e["step"] >= at, (want, e)
    assert "did not mark it complete" in failed[3]["error"]
    saved = _steps(_ck(r, "saved"))
    assert saved and min(saved) > failed[3]["step"], (saved, failed)
    assert complete_steps(tmp_path / "ck") == saved[-2:]
    assert r.summary is not None
    counts = r.summary["job"]["checkpoints"]
    assert (counts["saved"], counts["failed"], counts["abandoned"]) == (len(saved), 4, 0), counts
    assert counts["last_saved_step"] == saved[-1]


def test_a_checkpoint_still_writing_across_a_recovery_is_abandoned_and_never_meets_the_new_epoch(
    tmp_path: Path, reference: RunResult
) -> None:
    # Issue 41: node1 is lost in the middle of a save (its rank dies writing); rank 0's write
    # of that save goes on once the recovery has formed the checkpoint group again. Its
    # later collectives must not pair with the new epoch's (they fed a peer's unpickling an
    # empty buffer, and rank 0's next save waited on it forever: fenced as hung, job lost).
    r = _job(tmp_path, "write:outlive@20:r0,write:die@20:r1:node1")
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    assert [e for e in r.events if e["event"] == "state_replayed"], "no recovery ran"
    failed = _ck(r, "failed")
    assert [e["abandoned"] for e in failed] == [True] and failed[0]["step"] >= 20, failed
    assert "StaleEpoch" in failed[0]["error"], failed
    saved = _steps(_ck(r, "saved"))
    assert saved and saved[-1] > failed[0]["step"] and failed[0]["step"] not in saved, saved
    assert complete_steps(tmp_path / "ck") == saved[-2:]
    assert r.summary is not None and r.summary["job"]["checkpoints"]["abandoned"] == 1


def test_a_hung_checkpoint_defers_the_next_ones_and_never_stalls_training(tmp_path: Path, reference: RunResult) -> None:
    # rank 1's file server never answers from its first save at or after step 20 (rank 0
    # waits for it in DCP's gather): every later due save is deferred, training goes on,
    # and the end of the job waits a bounded time for the save before it says so.
    r = _job(tmp_path, "write:hang@20:r1")
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    failed = _ck(r, "failed")
    assert len(failed) == 1 and failed[0]["step"] >= 20 and "did not finish within" in failed[0]["error"], failed
    (deferred,) = _ck(r, "deferred")
    assert deferred["step"] > failed[0]["step"] and "2 rank(s) still writing" in deferred["reason"], deferred
    saved = _steps(_ck(r, "saved"))
    assert saved and max(saved) < failed[0]["step"], saved
    assert complete_steps(tmp_path / "ck") == saved[-2:]
    assert r.summary is not None
    counts = r.summary["job"]["checkpoints"]
    assert (counts["saved"], counts["failed"], counts["deferred"]) == (len(saved), 1, 1), counts
