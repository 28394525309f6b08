"""A spare that takes a failed node's ranks is, to the training script, a process that ran
the job from the start: under real resil-run, node processes and gloo, a loop keyed on
object identity (tests/launcher/run/train_identity.py: FSDP2 + TP, one norm collective per
gradient mesh object) recovers a node loss bitwise, and every rank's reachable structure
(meshes and their identity over parameters, gradients and optimizer state, groups,
placements, process settings) equals that rank's in a failure-free run. The warmed spare
once issued one collective fewer than its peers here, and gloo aborted a survivor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launcher.structure import differences

from .conftest import REPO, RunResult, start_job
from .test_join import _lose, _wait
from .test_sharded import assert_same
from .test_snapshots import STEPS as SHARDED_STEPS
from .test_snapshots import job as snapshot_job

SCRIPT = REPO / "tests" / "launcher" / "run" / "train_identity.py"

pytestmark = pytest.mark.timeout(300)


def job(tmp: Path, *args: str, nodes: int, spares: int, script: Path | str = SCRIPT) -> RunResult:
    return snapshot_job(tmp, script, *args, nodes=nodes, spares=spares)  # 14 steps, 2 ranks a node


def lost_after_warmup(tmp: Path, script: str) -> RunResult:
    """3 nodes x 2 ranks, one a spare; every rank holds at step 7 until the spare has warmed
    up, then node0 (its node process and workers) is lost: the spare that takes over is a
    warmed one whatever the machine's load."""
    gate = tmp / "release"
    job = start_job(
        tmp,
        "--heartbeat-timeout",
        "4",
        "--hang-timeout",
        "60",  # a held rank is not hung
        nodes=3,
        spares=1,
        nproc=2,
        steps=SHARDED_STEPS,
        script=f"{script} --hold-at 7 --gate {gate}",
    )
    try:
        warmed = _wait(job, lambda e: e["event"] == "spare_warmed", "the spare's warm-up", timeout_s=180)
        assert warmed.get("error") is None, warmed
        _lose(job, "local-node0")
        _wait(job, lambda e: e["event"] == "spare_assigned", "the takeover")
        gate.touch()
        return job.finish(timeout_s=240)
    finally:
        gate.touch()
        if job.p.poll() is None:
            job.p.kill()
            job.p.communicate()


def structures(tmp: Path) -> dict[int, dict]:
    return {
        int(p.name.rsplit("rank", 1)[1].removesuffix(".json")): json.loads(p.read_text())
        for p in tmp.glob("final.pt.structure-rank*.json")
    }


def assert_like_reference(ref: RunResult, r: RunResult, tmp: Path) -> None:
    """Bitwise the failure-free run's final state, and every rank's structure that rank's there."""
    assert r.final is not None and ref.final is not None
    assert_same(ref.final, r.final, "final")
    want, got = structures(tmp / "ref"), structures(tmp / "run")
    assert sorted(want) == sorted(got) == [0, 1, 2, 3]
    for rank in want:
        assert not differences(want[rank], got[rank]), (rank, differences(want[rank], got[rank])[:10])


def test_a_loop_keyed_on_mesh_identity_recovers_bitwise_on_a_warmed_spare(tmp_path: Path) -> None:
    ref = job(tmp_path / "ref", nodes=2, spares=0)
    assert ref.rc == 0, ref.stderr[-3000:]
    r = lost_after_warmup(tmp_path / "run", str(SCRIPT))
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary is not None and len(r.summary["failures"]) == 1, r.summary
    assert_like_reference(ref, r, tmp_path)


@pytest.mark.parametrize("kind", ["hsdp", "fsdp"])
def test_a_spare_after_takeover_is_each_ranks_fresh_self_for_hsdp_and_plain_fsdp2(tmp_path: Path, kind: str) -> None:
    """The same comparison for HSDP (the spare receives its state from a replica) and plain
    FSDP2 (a rollback to peer-memory snapshots)."""
    script = f"{SCRIPT} --kind {kind}"
    ref = job(tmp_path / "ref", nodes=2, spares=0, script=script)
    assert ref.rc == 0, ref.stderr[-3000:]
    r = lost_after_warmup(tmp_path / "run", script)
    assert r.rc == 0, r.stderr[-3000:]
    replays = [e["source"] for e in r.events if e["event"] == "state_replayed"]
    assert replays and set(replays) == {"replica" if kind == "hsdp" else "snapshot"}, replays
    assert_like_reference(ref, r, tmp_path)


def test_a_spare_that_issues_other_collectives_stops_the_job_in_one_line(tmp_path: Path) -> None:
    """A program error: the script skips a collective on a process that joined late. The
    first step after the recovery checks every collective (launcher/worker/collective_check.py),
    so the job stops naming it instead of gloo aborting a survivor and the job burning
    spares on healthy nodes."""
    r = job(tmp_path, "--inject", "nodeloss:node0@7", nodes=4, spares=2, script=f"{SCRIPT} --diverge-on-spare")
    assert r.rc != 0
    lines = [ln for ln in r.stderr.splitlines() if "collective mismatch" in ln]
    assert lines, r.stderr[-3000:]
    line = lines[0]
    assert "rank 0-1 (a process that joined after the job began) issued allreduce(int64" in line, line
    assert "the world group while rank 2-3 issued allreduce(float32, 1 element) on the" in line, line
    assert "program error" in line
    assert "signal 6" not in r.stderr and "EnforceNotMet" not in r.stderr, r.stderr[-3000:]
    assert r.summary is not None and "collective mismatch" in r.summary["reason"], r.summary
    assert len(r.summary["failures"]) == 1, r.summary["failures"]  # the injected loss only: no spare burnt


def test_a_backend_abort_for_a_mismatch_right_after_a_recovery_stops_the_job_in_one_line(tmp_path: Path) -> None:
    """The same program error one step later, where nothing checks each collective: gloo
    kills a rank (SIGABRT) with its own message. The node process reads it in the rank's
    last output (launcher/node/worker_output.py), and the controller stops the job with it
    instead of replacing a healthy node."""
    r = job(tmp_path, "--inject", "nodeloss:node0@7", nodes=4, spares=2, script=f"{SCRIPT} --abort-on-spare")
    assert r.rc != 0
    failed = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(failed) == 1, r.stderr[-3000:]
    assert "collective mismatch right after a recovery" in failed[0], failed[0]
    assert "signal 6" in failed[0] and "program error" in failed[0], failed[0]
    assert r.stderr.count("takes over") == 1, r.stderr[-3000:]  # one takeover: the second spare is never spent
