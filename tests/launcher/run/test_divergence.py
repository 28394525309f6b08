"""Silent divergence under real resil-run: a rank whose state drifts from its replicas
(a GPU computing wrong numbers; injected as a nudged parameter) is caught by the
fingerprint comparison, outvoted, replaced like a failed node, and the job ends
bitwise identical to a failure-free run."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import RunResult, run_job
from .test_sharded import assert_same

# The fault fires once the controller hears of its step (tenths of a second later); the steps
# after it must outlast that on a loaded machine (20 steps of this model, ~0.5 s, did not).
STEPS = 60

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


def test_two_replicas_that_disagree_stop_the_job_in_one_line(tmp_path: Path) -> None:
    r = run_job(tmp_path, "--fingerprint-every", "2", "--inject", "diverge:node1@5", nodes=2, spares=0, steps=STEPS)
    assert r.rc != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(lines) == 1 and "no majority" in lines[0], r.stderr[-3000:]
