"""Silent divergence under real resil-run: a rank whose state drifts from its replicas
(a GPU computing wrong numbers; injected as a nudged parameter) is caught by the
fingerprint comparison, outvoted, replaced like a failed node, and the job ends
bitwise identical to a failure-free run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, RunResult, run_job
from .test_sharded import assert_same

# The fault fires once the controller hears of its step (tenths of a second later); the steps
# after it must outlast that on a loaded machine (20 steps of this model, ~0.5 s, did not).
STEPS = 60

HSDP = REPO / "examples" / "train_hsdp.py"

pytestmark = pytest.mark.timeout(240)


def test_a_rank_outvoted_by_its_replicas_is_replaced_and_the_job_ends_bitwise_identical(tmp_path: Path) -> None:
    ref = run_job(tmp_path / "ref", nodes=3, spares=0, steps=STEPS)
    assert ref.rc == 0, ref.stderr[-2000:]
    # Every commit: the nudge lands inside commit(), after this step's backward, so the compare at
    # the same commit catches it before the nudged rank's gradients reach anyone. Compared every M
    # steps, the odd rank's gradients of the steps in between are averaged into every replica: the
    # rank is still caught and replaced, but the state is no longer the failure-free one.
    r: RunResult = run_job(
        tmp_path / "hurt", "--fingerprint-every", "1", "--inject", "diverge:node1@7", nodes=4, spares=1, steps=STEPS
    )
    assert r.rc == 0, r.stderr[-3000:]
    caught = [e for e in r.events if e["event"] == "replica_diverged"]
    assert len(caught) == 1 and caught[0]["odd"] == [1], caught
    assert r.summary is not None and len(r.summary["failures"]) == 1
    assert r.final is not None and r.final["step"] == STEPS
    assert_same(ref.final, r.final, "final")


def test_a_divergence_caught_late_rolls_every_rank_back_to_the_last_agreed_step(tmp_path: Path) -> None:
    # Compared every 5 steps: the odd rank's gradients of the steps before the compare reach
    # every replica. Every rank keeps its state at the last agreeing compare and returns to
    # it at the recovery that replaces the odd rank: the steps since are redone, bitwise.
    ref = run_job(tmp_path / "ref", nodes=3, spares=0, steps=STEPS)
    assert ref.rc == 0, ref.stderr[-2000:]
    r = run_job(
        tmp_path / "hurt", "--fingerprint-every", "5", "--inject", "diverge:node1@20", nodes=4, spares=1, steps=STEPS
    )
    assert r.rc == 0, r.stderr[-3000:]
    (caught,) = [e for e in r.events if e["event"] == "replica_diverged"]
    assert caught["odd"] == [1] and caught["step"] % 5 == 0 and caught["agreed"] == caught["step"] - 5, caught
    (back,) = [e for e in r.events if e["event"] == "rolled_back"]
    assert back["reason"] == "divergence" and back["step"] == caught["agreed"] and back["steps_redone"] == 5, back
    assert not [e for e in r.events if e["event"] == "state_unvouched"]
    assert r.summary is not None and len(r.summary["failures"]) == 1
    assert r.summary["failures"][0]["steps_redone"] == 5, r.summary["failures"]
    assert r.summary["job"].get("unvouched") is None, r.summary["job"]
    assert r.final is not None and r.final["step"] == STEPS
    assert_same(ref.final, r.final, "final")


def hsdp_pair(tmp_path: Path, replica_groups: int) -> tuple[RunResult, RunResult]:
    """A failure-free HSDP run (shards of 2, one node per replica group) and the same with one
    spare, compared every 5 steps, node1 drifting near step 20."""
    hsdp, common = f"{HSDP} --shard-size 2", ("--heartbeat-timeout", "4")
    n = replica_groups
    ref = run_job(tmp_path / "ref", *common, nodes=n, spares=0, nproc=2, steps=40, script=hsdp, timeout_s=240)
    assert ref.rc == 0, ref.stderr[-2000:]
    flags = (*common, "--fingerprint-every", "5", "--inject", "diverge:node1@20")
    r = run_job(tmp_path / "hurt", *flags, nodes=n + 1, spares=1, nproc=2, steps=40, script=hsdp, timeout_s=240)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.final is not None and r.final["step"] == 40
    assert_same(ref.final, r.final, "final")
    return ref, r


def test_hsdp_three_replica_groups_divergence_caught_late_ends_bitwise_identical(tmp_path: Path) -> None:
    # The layout: 3 replica groups of 2 shards, compared every 5 steps. Each rank
    # returns to its own copy; the spare receives the agreed step from a replica.
    _, r = hsdp_pair(tmp_path, 3)
    (caught,) = [e for e in r.events if e["event"] == "replica_diverged"]
    assert caught["odd"] and all(rank in (2, 3) for rank in caught["odd"]), caught  # node1's ranks
    (back,) = [e for e in r.events if e["event"] == "rolled_back"]
    assert back["step"] == caught["step"] - 5 and back["steps_redone"] == 5, back
    assert r.summary is not None and r.summary["failures"][0]["steps_redone"] == 5, r.summary["failures"]


def test_hsdp_two_replica_groups_that_disagree_are_arbitrated_by_the_spare(tmp_path: Path) -> None:
    # The common HSDP layout: 2 replica groups. Each shard's pair disagrees with no majority:
    # node1's ranks leave, every rank returns to the last agreed step, and the pairs agree
    # again with the spare in node1's place.
    _, r = hsdp_pair(tmp_path, 2)
    first = [e for e in r.events if e["event"] == "replica_diverged"][0]
    assert first["arbitrate"] and all(rank in (2, 3) for rank in first["arbitrate"]), first
    (arb,) = [e for e in r.events if e["event"] == "replica_arbitrated"]
    assert arb["step"] == first["step"] and arb["leaving"] == [], arb
    (back,) = [e for e in r.events if e["event"] == "rolled_back"]
    assert back["step"] == first["step"] - 5, back
    assert r.summary is not None and "unvouched" not in r.summary["job"]


def test_a_divergence_with_no_agreed_state_to_return_to_is_said_in_the_summary(tmp_path: Path) -> None:
    # Found at the first compare (step 80; the nudge lands within a few steps of 1): there is no
    # agreed state to return to. The job goes on from the majority's state, and says, in the
    # summary and in job_finished, that it cannot vouch for it.
    r = run_job(tmp_path, "--fingerprint-every", "80", "--inject", "diverge:node1@1", nodes=4, spares=1, steps=100)
    assert r.rc == 0, r.stderr[-3000:]
    (caught,) = [e for e in r.events if e["event"] == "replica_diverged"]
    assert caught["step"] == 80 and caught["agreed"] == -1, caught
    assert not [e for e in r.events if e["event"] == "rolled_back"]
    (said,) = [e for e in r.events if e["event"] == "state_unvouched"]
    (fin,) = [e for e in r.events if e["event"] == "job_finished"]
    assert fin["unvouched"] == said["reason"] and "diverged at step 80" in said["reason"], (fin, said)
    assert r.summary is not None and r.summary["job"]["unvouched"] == said["reason"]
    report = subprocess.run(
        [sys.executable, "-m", "resild.cli", "report", str(tmp_path / "events.jsonl")], capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    (line,) = [ln for ln in report.stdout.splitlines() if "cannot vouch" in ln]
    assert said["reason"] in line


def test_with_rollback_off_a_late_divergence_is_said_not_vouched_for(tmp_path: Path) -> None:
    r = run_job(
        tmp_path,
        "--fingerprint-every",
        "5",
        "--inject",
        "diverge:node1@20",
        nodes=4,
        spares=1,
        steps=STEPS,
        env={"RESILD_DIVERGENCE_ROLLBACK": "0"},
    )
    assert r.rc == 0, r.stderr[-3000:]
    assert not [e for e in r.events if e["event"] == "rolled_back"]
    assert r.summary is not None and "RESILD_DIVERGENCE_ROLLBACK=0" in r.summary["job"]["unvouched"], r.summary


# The suspect (the higher rank) leaves first, whichever node drifted: a transient drift reaches
# the other replica through the averaged gradients, so the recomputation beside a fresh spare
# matches neither first result; what settles it is that the pair now agrees.
@pytest.mark.parametrize("hurt", ["node1", "node0"])
def test_a_spare_arbitrates_between_two_replicas_that_disagree(tmp_path: Path, hurt: str) -> None:
    ref = run_job(tmp_path / "ref", nodes=2, spares=0, steps=STEPS)
    assert ref.rc == 0, ref.stderr[-2000:]
    r = run_job(
        tmp_path / "hurt",
        "--fingerprint-every",
        "5",
        "--inject",
        f"diverge:{hurt}@20",
        nodes=4,
        spares=2,
        steps=STEPS,
    )
    assert r.rc == 0, r.stderr[-3000:]
    first = [e for e in r.events if e["event"] == "replica_diverged"][0]
    assert first["undecided"] == [[0, 1]] and first["arbitrate"] == [1], first
    (arb,) = [e for e in r.events if e["event"] == "replica_arbitrated"]
    assert arb["step"] == first["step"] and arb["leaving"] == [], arb
    (sa,) = [e for e in r.events if e["event"] == "spare_assigned"]
    assert sa["failed"] == "local-node1", sa
    assert not [e for e in r.events if e["event"] == "state_unvouched"]
    assert r.summary is not None and "unvouched" not in r.summary["job"]
    assert r.final is not None and r.final["step"] == STEPS
    assert_same(ref.final, r.final, "final")


def test_two_replicas_that_disagree_stop_the_job_in_one_line(tmp_path: Path) -> None:
    r = run_job(tmp_path, "--fingerprint-every", "2", "--inject", "diverge:node1@5", nodes=2, spares=0, steps=STEPS)
    assert r.rc != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(lines) == 1 and "no majority" in lines[0], r.stderr[-3000:]
