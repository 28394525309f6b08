"""Recovery without a second copy: plain FSDP2 and FSDP2 + tensor parallel under real
resil-run, node processes and gloo. No rank holds another's state, so every recovery
is a rollback to the newest peer-memory snapshot complete for every rank. Every
recovered run must end bitwise identical to the failure-free run, having redone at
most the steps since that snapshot (snapshots every step here: at most 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.worker.redundancy.snapshot_budget import BUCKETS

from .conftest import REPO, RunResult, run_job
from .test_sharded import assert_same

FSDP = REPO / "examples" / "train_fsdp.py"
FSDP_TP = REPO / "examples" / "train_fsdp_tp.py"
STEPS = 14

pytestmark = pytest.mark.timeout(300)


def job(tmp: Path, script: Path | str, *args: str, nodes: int, spares: int, nproc: int = 2) -> RunResult:
    # Up to 10 processes on 2 cores: a starved node process must not be declared lost (see test_sharded).
    return run_job(
        tmp,
        "--heartbeat-timeout",
        "4",
        "--hang-timeout",
        "3",
        *args,
        nodes=nodes,
        spares=spares,
        nproc=nproc,
        steps=STEPS,
        script=script,
        timeout_s=240,
    )


def reference(tmp: Path, script: Path, nodes: int, nproc: int = 2) -> RunResult:
    r = job(tmp, script, nodes=nodes, spares=0, nproc=nproc)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.final is not None and r.final["step"] == STEPS
    return r


@pytest.fixture(scope="module")
def fsdp_ref(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return reference(tmp_path_factory.mktemp("fsdp-ref"), FSDP, nodes=2)


@pytest.fixture(scope="module")
def tp_ref(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return reference(tmp_path_factory.mktemp("tp-ref"), FSDP_TP, nodes=2)


@pytest.fixture(scope="module")
def fsdp3_ref(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return reference(tmp_path_factory.mktemp("fsdp3-ref"), FSDP, nodes=3, nproc=1)


def rolled_back(r: RunResult, ref: RunResult, n_failures: int = 1) -> list[dict]:
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary is not None, r.stderr[-2000:]
    assert len(r.summary["failures"]) == n_failures, r.summary["failures"]
    assert r.final is not None
    assert_same(ref.final, r.final, "final")
    rbs = [e for e in r.events if e["event"] == "rolled_back"]
    assert len(rbs) == n_failures, rbs
    for e in rbs:
        assert 0 <= e["steps_redone"] <= 1, e
    replays = [e for e in r.events if e["event"] == "state_replayed"]
    assert replays and all(e["source"] == "snapshot" for e in replays), replays
    assert all(e["authenticated"] for e in replays), replays  # tagged under the job's data key
    # thawed into the spare's built parameters (redundancy wires the live state in)
    assert all(e["in_place_bytes"] > 0 for e in replays), replays
    # and what has no live home into the memory its warm-up touched, when it kept some
    # before the fault (launcher/worker/transport/landing_pool.py; the shapes of the shard at coordinate 0: the
    # tests' faults take ranks whose shards have them)
    kept = [e for e in r.events if e["event"] == "spare_warmed" and e.get("landing_bytes")]
    assert all(e["in_place_bytes"] + e["landed_bytes"] <= e["bytes"] for e in replays), replays
    if {e["node"] for e in kept} >= {e["node"] for e in replays} and len(kept) >= len(replays):
        assert all(e["landed_bytes"] > 0 for e in replays), (replays, kept)
    return rbs


@pytest.mark.parametrize("fault", ["nodeloss:node1@7", "kill:node0@7", "hang:node1@7"])
def test_plain_fsdp2_fault_rolls_back_to_a_snapshot_bitwise(tmp_path: Path, fsdp_ref: RunResult, fault: str) -> None:
    r = job(tmp_path, FSDP, "--inject", fault, nodes=3, spares=1)
    rolled_back(r, fsdp_ref)
    # The spare received its two ranks' shards from the node holding their copies (node0
    # holds node1's and the other way round), never from itself.
    lost = {0, 1} if "node0" in fault else {2, 3}
    got = {e["rank"]: e["sources"] for e in r.events if e["event"] == "state_replayed"}
    assert set(got) == lost, got
    assert all(not (set(src) & lost) for src in got.values()), got


def test_auto_cadence_snapshots_the_same_steps_on_every_rank_and_rolls_back_bitwise(
    tmp_path: Path, fsdp_ref: RunResult
) -> None:
    # --snapshot-every auto: every rank asks for the probe cadence (8) until it has measured
    # what a snapshot costs; the rollback redoes at most the steps since the last one.
    r = job(tmp_path, FSDP, "--snapshot-every", "auto", "--inject", "nodeloss:node1@7", nodes=3, spares=1)
    assert r.rc == 0, r.stderr[-3000:]
    assert_same(fsdp_ref.final, r.final, "final")
    (rb,) = [e for e in r.events if e["event"] == "rolled_back"]
    assert rb["step"] % 8 == 0, rb  # a step of the probe cadence (nothing measured in 14 steps)
    ends = [e for e in r.events if e["event"] == "snapshots"]
    assert len(ends) == 4 and all(e["auto"] and e["every"] in BUCKETS for e in ends), ends
    # Since the recovery the spare and the survivors snapshotted the very same steps: the
    # first commit after it (the agreed step itself when that is the start), then the
    # agreed cadence.
    since = {tuple(e["since_join"]) for e in ends}
    assert len(since) == 1, ends
    steps = next(iter(since))
    assert steps and steps[0] == (rb["step"] if rb["step"] == 0 else rb["step"] + 1), (steps, rb)


def test_fsdp2_with_tensor_parallel_node_loss_rolls_back_bitwise(tmp_path: Path, tp_ref: RunResult) -> None:
    # (a hang and a worker kill reach the same rollback: the plain-FSDP2 tests cover their detectors)
    r = job(tmp_path, FSDP_TP, "--inject", "nodeloss:node0@7", nodes=3, spares=1)
    rolled_back(r, tp_ref)


def test_two_adjacent_nodes_lost_in_one_step_with_two_copies(tmp_path: Path, fsdp3_ref: RunResult) -> None:
    # Ranks 0 and 1 (node0, node1) keep their copies on the next two nodes: node1's copy
    # of rank 0 dies with it, the copy on node2 survives.
    r = job(
        tmp_path,
        FSDP,
        "--snapshot-copies",
        "2",
        "--inject",
        "nodeloss:node0@7",
        "--inject",
        "nodeloss:node1@7",
        nodes=5,
        spares=2,
        nproc=1,
    )
    assert r.rc == 0, r.stderr[-3000:]
    assert_same(fsdp3_ref.final, r.final, "final")
    got = {e["rank"]: e["sources"] for e in r.events if e["event"] == "state_replayed"}
    assert got == {0: [2], 1: [2]} or (set(got) == {0, 1} and all(s == [2] for s in got.values())), got


def test_a_corrupted_snapshot_copy_is_detected_and_another_copy_used(tmp_path: Path, fsdp3_ref: RunResult) -> None:
    # node1 holds the first copy of rank 0 and its memory goes bad; node0 is then lost:
    # the damaged copy fails its checksum and rank 0's state comes from node2.
    r = job(
        tmp_path,
        FSDP,
        "--snapshot-copies",
        "2",
        "--inject",
        "corrupt:node1@3",
        "--inject",
        "kill:node0@7",
        nodes=4,
        spares=1,
        nproc=1,
    )
    rolled_back(r, fsdp3_ref)
    bad = [e for e in r.events if e["event"] == "snapshot_corrupt"]
    assert bad and all(e["holder"] == 1 for e in bad), bad
    got = {e["rank"]: e["sources"] for e in r.events if e["event"] == "state_replayed"}
    assert got == {0: [2]}, got


def test_every_copy_lost_without_a_checkpoint_stops_with_one_line(tmp_path: Path) -> None:
    # One copy, and both nodes holding rank 0's state (its own and the copy) die together.
    r = job(
        tmp_path,
        FSDP,
        "--snapshot-copies",
        "1",
        "--inject",
        "nodeloss:node0@5",
        "--inject",
        "nodeloss:node1@5",
        nodes=5,
        spares=2,
        nproc=1,
    )
    assert r.rc != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("resil-run: job failed:")]
    assert len(lines) == 1 and "checkpointless recovery is impossible" in lines[0], r.stderr[-3000:]
    assert "no copy left of rank" in lines[0], lines[0]
    assert r.final is None


def test_every_copy_lost_with_a_checkpoint_dir_continues_from_the_newest_checkpoint_in_the_same_run(
    tmp_path: Path, fsdp3_ref: RunResult
) -> None:
    ck = tmp_path / "ck"
    r = job(
        tmp_path / "run",
        FSDP,
        "--snapshot-copies",
        "1",
        "--checkpoint-dir",
        str(ck),
        "--checkpoint-every",
        "4",
        "--inject",
        "nodeloss:node0@7",
        "--inject",
        "nodeloss:node1@7",
        nodes=5,
        spares=2,
        nproc=1,
    )
    assert r.rc == 0, r.stderr[-3000:]
    assert_same(fsdp3_ref.final, r.final, "final")
    (loaded,) = [e for e in r.events if e["event"] == "checkpoint_loaded"]
    # The faults fire when the controller hears of committed step 7, which under load can be
    # after step 8's checkpoint completed: the newest complete one is what must be loaded. Rank
    # 0 says a save complete (checkpoint_saved), and it dies with node0: step 8's may be complete
    # on disk and never said, so the loaded step is at least the newest said.
    saved = [e["step"] for e in r.events if e["event"] == "checkpoint_saved" and e["t_mono"] < loaded["t_mono"]]
    assert loaded["step"] in (4, 8) and loaded["step"] >= max(saved, default=4), (loaded, saved)
    assert r.summary is not None
    assert [f["recovered_from"] for f in r.summary["failures"] if f["recovered_from"]] == ["checkpoint"]


def test_a_resubmitted_job_resumes_from_its_checkpoints_without_user_code(tmp_path: Path, fsdp3_ref: RunResult) -> None:
    ck = tmp_path / "ck"
    args = ("--checkpoint-dir", str(ck), "--checkpoint-every", "4")
    # No spare: the node loss at step 9 ends the job, with checkpoints of steps 4 and 8 on disk.
    first = job(tmp_path / "first", FSDP, *args, "--inject", "nodeloss:node1@9", nodes=3, spares=0, nproc=1)
    assert first.rc != 0 and first.final is None
    again = job(tmp_path / "again", FSDP, *args, nodes=3, spares=0, nproc=1)
    assert again.rc == 0, again.stderr[-3000:]
    assert "loaded checkpoint step 8" in again.stderr, again.stderr[-2000:]
    assert_same(fsdp3_ref.final, again.final, "final")
