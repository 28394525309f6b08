"""Wrong gradients under real resil-run (--verify-every): a rank whose GPU computes wrong
gradients for one step (injected: badgrad) is caught before anyone commits that step,
replaced like a failed node, and the job ends bitwise identical to a failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import REPO, RunResult, run_job
from .test_sharded import assert_same

STEPS = 60
DROPOUT = REPO / "tests" / "launcher" / "run" / "train_dropout.py"
DDP = REPO / "examples" / "train_ddp_amp.py"

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    r = run_job(tmp_path_factory.mktemp("verify-ref"), nodes=3, spares=0, steps=STEPS, script=DROPOUT)
    assert r.rc == 0, r.stderr[-2000:]
    return r


def test_every_step_computed_twice_changes_nothing(tmp_path: Path, reference: RunResult) -> None:
    # dropout and a data cursor (extra=): the second pass of each step draws the same random
    # numbers and reads the same batch, so the job is the failure-free one, bitwise
    r = run_job(tmp_path, "--verify-every", "1", nodes=3, spares=0, steps=STEPS, script=DROPOUT)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary is not None and r.summary["failures"] == [] and "unvouched" not in r.summary["job"]
    verified = [e for e in r.events if e["event"] == "steps_verified"]
    assert sorted(e["rank"] for e in verified) == [0, 1, 2] and all(e["verified"] == STEPS for e in verified), verified
    assert_same(reference.final, r.final, "final")


def test_wrong_gradients_are_caught_before_the_commit_and_the_job_ends_bitwise_identical(
    tmp_path: Path, reference: RunResult
) -> None:
    r = run_job(
        tmp_path, "--verify-every", "1", "--inject", "badgrad:node1@20", nodes=4, spares=1, steps=STEPS, script=DROPOUT
    )
    assert r.rc == 0, r.stderr[-3000:]
    (caught,) = [e for e in r.events if e["event"] == "gradients_differed"]
    assert caught["rank"] == 1 and caught["ranks"] == 1, caught
    assert r.summary is not None and len(r.summary["failures"]) == 1, r.summary
    f = r.summary["failures"][0]
    assert f["node"] == "local-node1" and "different gradients" in f["cause"] and f["steps_redone"] == 0, f
    assert "unvouched" not in r.summary["job"]
    assert_same(reference.final, r.final, "final")


def test_wrong_gradients_nobody_verified_are_said_in_the_summary(tmp_path: Path, reference: RunResult) -> None:
    r = run_job(tmp_path, "--inject", "badgrad:node1@20", nodes=3, spares=0, steps=STEPS, script=DROPOUT)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary is not None and r.summary["failures"] == []
    why = r.summary["job"]["unvouched"]
    assert "badgrad" in why and "--verify-every 0" in why, why
    assert r.final is not None and r.final["step"] == STEPS
    assert any(not v.equal(r.final["model"][k]) for k, v in reference.final["model"].items())  # it did spread


def test_a_step_that_does_not_reproduce_stops_the_job_in_one_line(tmp_path: Path) -> None:
    # the data cursor is not handed to resild: the second pass reads the next batch on every rank
    r = run_job(tmp_path, "--verify-every", "5", nodes=3, spares=1, steps=20, script=f"{DROPOUT} --untracked-cursor")
    assert r.rc == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(lines) == 1 and "does not reproduce" in lines[0] and "2 of 2 ranks" in lines[0], r.stderr[-3000:]
    assert not [e for e in r.events if e["event"] == "spare_assigned"]  # a program error: no node replaced


@pytest.mark.parametrize(
    "args,why",
    [
        (("--verify-every", "-1"), "--verify-every"),
        (("--fingerprint-every", "-2"), "--fingerprint-every"),
    ],
)
def test_bad_counts_are_one_line_and_exit_2(tmp_path: Path, args: tuple[str, ...], why: str) -> None:
    r = run_job(tmp_path, *args, nodes=2, spares=0, steps=5)
    assert r.rc == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_a_model_that_averages_its_own_gradients_is_refused_in_one_line(tmp_path: Path) -> None:
    r = run_job(tmp_path, "--verify-every", "2", nodes=2, spares=0, steps=5, script=DDP)
    assert r.rc == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(lines) == 1 and "DDP or FSDP2" in lines[0], r.stderr[-3000:]
