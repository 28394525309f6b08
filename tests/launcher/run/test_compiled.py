"""A compiled model's spare is ready before it is needed: under real resil-run, node
processes and gloo, `examples/train_fsdp.py --compile` hands `launcher.init(prepare=...)`
a function that builds, compiles and runs the model once; a waiting spare runs it on a
mesh of stand-in groups, so after taking over its real model (another instance of the
same classes) finds every graph compiled: its first step compiles none (dynamo's
counters, reported as `spare_compiled`), and the run ends bitwise as a failure-free one.
Without the preparation (RESILD_SPARE_PREPARE=0) the spare compiles after the takeover,
and says so in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import REPO, RunResult, run_job
from .test_sharded import assert_same

FSDP = REPO / "examples" / "train_fsdp.py"
HSDP = REPO / "examples" / "train_hsdp.py"
STEPS = 14

pytestmark = pytest.mark.timeout(400)


def job(
    tmp: Path,
    *args: str,
    nodes: int,
    spares: int,
    env: dict[str, str] | None = None,
    script: Path = FSDP,
    nproc: int = 1,
) -> RunResult:
    return run_job(
        tmp,
        "--heartbeat-timeout",
        "4",
        "--hang-timeout",
        "30",  # a first step compiles (seconds on two loaded cores): no hang
        *args,
        nodes=nodes,
        spares=spares,
        nproc=nproc,
        steps=STEPS,
        script=f"{script} --compile",
        timeout_s=300,
        env=env,
    )


@pytest.fixture(scope="module")
def compiled_ref(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    r = job(tmp_path_factory.mktemp("compiled-ref"), nodes=2, spares=0)
    assert r.rc == 0, r.stderr[-3000:]
    return r


def spare_events(r: RunResult, name: str) -> list[dict]:
    return [e for e in r.events if e["event"] == name]


def test_a_prepared_spare_compiles_nothing_after_taking_over(tmp_path: Path, compiled_ref: RunResult) -> None:
    r = job(tmp_path, "--inject", "kill:node0@8", nodes=3, spares=1)
    assert r.rc == 0, r.stderr[-3000:]
    assert r.summary is not None and len(r.summary["failures"]) == 1
    warmed = spare_events(r, "spare_warmed")
    assert warmed and all(e.get("prepared") is True for e in warmed), warmed
    compiled = spare_events(r, "spare_compiled")
    assert [e["graphs"] for e in compiled] == [0], compiled
    assert "graph(s) after taking over" not in r.stderr
    assert r.final is not None and compiled_ref.final is not None
    assert_same(compiled_ref.final, r.final, "final")


def test_without_the_preparation_the_spare_compiles_after_taking_over_and_says_so(
    tmp_path: Path, compiled_ref: RunResult
) -> None:
    r = job(tmp_path, "--inject", "kill:node0@8", nodes=3, spares=1, env={"RESILD_SPARE_PREPARE": "0"})
    assert r.rc == 0, r.stderr[-3000:]
    compiled = spare_events(r, "spare_compiled")
    assert len(compiled) == 1 and compiled[0]["graphs"] > 0, compiled
    assert "compiled" in r.stderr and "graph(s) after taking over" in r.stderr
    assert r.final is not None and compiled_ref.final is not None
    assert_same(compiled_ref.final, r.final, "final")


def test_a_prepared_hsdp_spare_compiles_nothing_and_receives_its_state_from_a_replica(tmp_path: Path) -> None:
    """examples/train_hsdp.py --compile, 2 x 2 (replicate x shard): the same preparation, and
    the state comes from the replica (no rollback)."""
    ref = job(tmp_path / "ref", nodes=2, spares=0, script=HSDP, nproc=2)
    assert ref.rc == 0, ref.stderr[-3000:]
    r = job(tmp_path / "run", "--inject", "kill:node0@8", nodes=3, spares=1, script=HSDP, nproc=2)
    assert r.rc == 0, r.stderr[-3000:]
    assert [e["graphs"] for e in spare_events(r, "spare_compiled")] == [0, 0]  # the spare's two ranks
    replays = spare_events(r, "state_replayed")
    assert replays and all(e["source"] == "replica" for e in replays), replays
    assert r.final is not None and ref.final is not None
    assert_same(ref.final, r.final, "final")
