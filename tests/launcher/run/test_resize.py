"""Shrink and grow (`--min-replicas`): with no spare left a data-parallel job drops a lost
node's ranks and trains on; a spare that joins later grows it back to full width.

Real processes: the job runs examples/train.py held before some steps (tests/held_train.py)
so each loss and join lands while it runs; nodes are lost for real (SIGKILL of their
process group) and spares join with `resil-run --join`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.launcher.run.conftest import REPO, STEPS, RunResult, run_job, start_job
from tests.launcher.run.test_join import _events, _join, _lose, _release_and_reap, _wait

pytestmark = pytest.mark.timeout(300)
HOLDS = (10, 25)


def _resized(events: list[dict]) -> list[tuple[str, int, int]]:
    return [(e["how"], e["was"], e["world_size"]) for e in events if e["event"] == "job_resized"]


def _run(
    tmp_path: Path, *train_args: str, nodes: int = 3, nproc: int = 1, min_replicas: int = 2
) -> tuple[RunResult, list[subprocess.Popen]]:
    """`nodes` x `nproc` ranks, no spare: lose node 1 (shrink: `min_replicas` is what is left),
    then a spare joins (grow)."""
    full = nodes * nproc
    holds = ",".join(map(str, HOLDS))
    held = f"{REPO}/tests/held_train.py {tmp_path}/release {holds} {' '.join(train_args)}"
    # a held rank is, to the controller, a hung one: --hang-timeout beyond the hold
    job = start_job(
        tmp_path,
        *("--min-replicas", str(min_replicas), "--fingerprint-every", "1", "--hang-timeout", "270"),
        nodes=nodes,
        spares=0,
        nproc=nproc,
        script=held,
    )
    joiners: list[subprocess.Popen] = []
    try:
        _wait(job, lambda e: e["event"] == "full_strength_step", "the first step")
        _lose(job, "local-node1")  # no spare: the job shrinks
        _wait(job, lambda e: e["event"] == "job_resized" and e["how"] == "shrink", "the shrink")
        Path(f"{tmp_path}/release-{HOLDS[0]}").touch()
        joiners.append(_join(tmp_path / "run", job.env, "--nodes", "1"))
        grown = _wait(job, lambda e: e["event"] == "job_resized" and e["how"] == "grow", "the grow", 150.0)
        assert not any(e["event"] == "rank_done" for e in _events(job)), "grew after the end: nothing was tested"
        Path(f"{tmp_path}/release-{HOLDS[1]}").touch()
        r = job.finish(timeout_s=180)
    finally:
        _release_and_reap(job, [tmp_path / f"release-{hold}" for hold in HOLDS], joiners)
    assert r.rc == 0, r.stderr[-3000:]
    assert grown["ranks"] == list(range(full - nproc, full)) and grown["world_size"] == full
    assert _resized(r.events) == [("shrink", full, full - nproc), ("grow", full - nproc, full)]
    return r, joiners


@pytest.mark.parametrize("loop", ["train.py", "train_ddp_amp.py"])
def test_a_data_parallel_job_with_no_spare_shrinks_trains_on_and_grows_back_when_a_spare_joins(
    tmp_path: Path, loop: str
) -> None:
    """Plain data parallelism (job.sync's all-reduce) and DDP (its reducer on the job's group)."""
    r, joiners = _run(tmp_path, str(REPO / "examples" / loop))
    _check(r, joiners, full=3, lost=1)


def test_an_hsdp_job_with_no_spare_drops_a_replica_group_and_grows_back_when_a_spare_joins(tmp_path: Path) -> None:
    """FSDP2 HSDP, 2 replica groups of 2 ranks, one per node, no spare, --min-replicas 1: a node
    lost, the same DeviceMesh object is reshaped to one replica group (FSDP2 all-reduces over
    groups of one) and trains on; a spare joins, the mesh is reshaped back to 2 groups, and the
    newcomer gets its shards from the surviving group. Fingerprints compared every commit."""
    hsdp = (str(REPO / "examples" / "train_hsdp.py"), "--shard-size", "2")
    r, joiners = _run(tmp_path, *hsdp, nodes=2, nproc=2, min_replicas=1)
    _check(r, joiners, full=4, lost=2)
    assert "rank 0: 4 -> 2 ranks, 1 replicas" in r.stderr and "rank 1: 2 -> 4 ranks, 2 replicas" in r.stderr


def _check(r: RunResult, joiners: list[subprocess.Popen], full: int, lost: int) -> None:
    assert r.final is not None and r.final["step"] == STEPS
    # the replicas compared fingerprints after every commit, the joined rank's too: identical
    assert not [e for e in r.events if e["event"] == "replica_diverged"]
    # the committed step never went back: every recovery resumed at or past the last commit before it
    assert r.summary is not None and all(f["steps_lost"] == 0 for f in r.summary["failures"])
    resumed = [e["step"] for e in r.events if e["event"] == "resumed"]
    assert resumed == sorted(resumed) and len(resumed) == 2, resumed
    # the loop saw both resizes through job.on_resize, on every rank that lived through them
    shrunk = full - lost
    assert f"rank 0: {full} -> {shrunk} ranks" in r.stderr and f"rank {shrunk - 1}: {full} -> {shrunk}" in r.stderr
    assert f"rank 0: {shrunk} -> {full} ranks" in r.stderr
    assert f"rank {full - 1}: {shrunk} -> {full}" not in r.stderr  # the newcomer: not told
    assert f"resild: the job shrank from {full} to {shrunk} ranks" in r.stderr
    assert [j.returncode for j in joiners] == [0]


def test_min_replicas_larger_than_the_job_is_refused_in_one_line(tmp_path: Path) -> None:
    from bench.commands import resil_run

    p = subprocess.run(
        resil_run("--local", "--nodes", "2", "--spares", "0", "--min-replicas", "3", "--", "true"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "Error: --min-replicas 3 is more than the job has: 2 active node(s) x 1 rank(s) = 2 replicas" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_sharded_job_under_min_replicas_stops_at_start_in_one_line(tmp_path: Path) -> None:
    """Only jobs with replicas shrink: a plain FSDP2 job asking for it is told so before step 0."""
    r = start_job(
        tmp_path, "--min-replicas", "1", spares=0, nproc=2, nodes=1, script=REPO / "examples" / "train_fsdp.py"
    ).finish(timeout_s=150)
    assert r.rc != 0
    why = "--min-replicas 1: this job cannot shrink: its mesh has no 'replicate' dimension"
    assert f"resild: {why}" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def _l2_diff(a: dict, b: dict) -> float:
    return float(torch.cat([(a["model"][k] - b["model"][k]).flatten() for k in a["model"]]).norm())


def test_keep_global_batch_accumulates_the_missing_ranks_batches_while_shrunk(tmp_path: Path) -> None:
    """examples/train.py --keep-global-batch (job.data_shards, job.shard_weight): while the job
    has 2 of its 3 ranks, it computes all 3 ranks' batches, so its training matches a
    failure-free run at full width up to summation order; the per-rank default does not.

    Compared by the L2 norm of the difference, not its largest element: under Adam a gradient
    element that is zero up to rounding gets a full learning-rate step whose sign is the
    rounding's, so summation order alone can move a weight by lr (measured: max 1e-3, L2 0.027
    in 1 of 4 runs, when the node was lost at step 2; else 4e-6), while the per-rank
    default's L2 distance is 3.5-4.8."""
    ref = run_job(tmp_path / "ref", nodes=3, spares=0)
    assert ref.rc == 0, ref.stderr[-2000:]
    kept, _ = _run(tmp_path / "kept", "--keep-global-batch")
    per_rank, _ = _run(tmp_path / "per-rank")
    assert ref.final is not None and kept.final is not None and per_rank.final is not None
    near, far = _l2_diff(ref.final, kept.final), _l2_diff(ref.final, per_rank.final)
    print(f"L2 |ref - kept| {near:.3g}, L2 |ref - per-rank| {far:.3g}")
    assert near < 0.02 * far, (near, far)
