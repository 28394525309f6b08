"""`resil-run --local --join RUN_DIR`: spares join a running job and take failed nodes' ranks.

The job runs examples/train.py held before some steps (tests/held_train.py), so each
node loss lands while it runs however loaded the machine; nodes are lost for real
(their node process group SIGKILLed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from bench.commands import resil_run
from resild.wire.keys import add_join_key, generate_keys
from tests.launcher.run.conftest import REPO, STEPS, RunResult, Started, assert_bitwise_equal, start_job

pytestmark = pytest.mark.timeout(300)
HOLDS = (10, 20, 30, 40)  # the job waits before these steps until the test releases them


def _events(job: Started) -> list[dict]:
    p = job.tmp / "events.jsonl"
    out = []
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _wait(job: Started, pred, what: str, timeout_s: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in _events(job):
            if pred(e):
                return e
        if job.p.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{what}: not seen (resil-run rc {job.p.poll()}); last events: {_events(job)[-5:]}")


def _join(run_dir: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        resil_run("--join", str(run_dir), *extra),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lose(job: Started, node: str) -> None:
    """The node is lost: its node process and every worker (they lead one process group)."""
    pid = [e["pid"] for e in _events(job) if e["event"] == "node_registered" and e["node"] == node][-1]
    os.killpg(pid, signal.SIGKILL)


def _release_and_reap(job: Started, gates: list[Path], joiners: list[subprocess.Popen]) -> None:
    """Whatever happened: every hold released, the job killed if it still runs, the joiners
    reaped (a test's own assertions come after)."""
    for gate in gates:
        gate.touch()
    if job.p.poll() is None:
        job.p.kill()
    for j in joiners:
        try:
            j.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            j.kill()
            j.communicate()


def _refused(run_dir: Path, env: dict[str, str], *extra: str) -> str:
    p = _join(run_dir, env, *extra)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, (p.returncode, out, err)
    (line,) = err.strip().splitlines()  # one line, no traceback
    return line


def test_a_job_with_one_spare_survives_four_losses_as_spares_join_between_them(
    tmp_path: Path, reference: RunResult
) -> None:
    held = f"{REPO}/tests/held_train.py {tmp_path}/release {','.join(map(str, HOLDS))}"
    job = start_job(tmp_path, "--hang-timeout", "60", script=held)  # a held rank is not hung
    run_dir = tmp_path / "run"
    joiners: list[subprocess.Popen] = []
    try:
        _wait(job, lambda e: e["event"] == "full_strength_step", "the first step")
        # Refused, in one line, and nothing in the job changes: a key that is not the job's,
        # a run directory naming another job.
        forged = tmp_path / "forged"
        shutil.copytree(run_dir, forged, ignore=shutil.ignore_patterns("keys", "fake-nvml"))
        mine = add_join_key(generate_keys(forged / "keys"))  # a pair of our own...
        shutil.copy(run_dir / "keys" / "join" / "server.key", mine.path / "server.key")  # ...for the real server
        assert "refused the join key" in _refused(forged, job.env)
        other = tmp_path / "other"
        shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("fake-nvml"))
        info = json.loads((other / "join.json").read_text())
        (other / "join.json").write_text(json.dumps({**info, "job": "0123456789ab"}))
        line = _refused(other, job.env)
        assert f"runs job {info['job']}, not '0123456789ab'" in line, line
        assert not any(e["event"] == "node_admitted" for e in _events(job))

        # Four losses, one spare at a time: the start-up spare, then three that joined.
        victims = ["local-node0", "local-node1", "local-node2"]
        takers = ["local-node2"]
        for k, hold in enumerate(HOLDS):
            if k > 0:  # a spare joins and warms up before the next loss
                joiners.append(_join(run_dir, job.env, "--nodes", "1"))
                seen = {e["node"] for e in _events(job) if e["event"] == "node_admitted"}
                admitted = _wait(job, lambda e, s=seen: e["event"] == "node_admitted" and e["node"] not in s, "a join")
                node = admitted["node"]
                takers.append(node)
                _wait(job, lambda e, n=node: e["event"] == "worker_registered" and e["node"] == n, f"{node} warm")
            victim = victims[k] if k < len(victims) else takers[1]  # the fourth: a node that joined
            _lose(job, victim)
            _wait(job, lambda e, v=victim: e["event"] == "spare_assigned" and e["failed"] == v, f"{victim} replaced")
            Path(f"{tmp_path}/release-{hold}").touch()
        r = job.finish(timeout_s=180)
    finally:
        _release_and_reap(job, [tmp_path / f"release-{hold}" for hold in HOLDS], joiners)
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    assigned = [(e["failed"], e["spare"]) for e in r.events if e["event"] == "spare_assigned"]
    assert assigned == list(zip(victims + [takers[1]], takers, strict=True)), assigned
    assert len(r.summary["failures"]) == 4 and all(f["steps_lost"] == 0 for f in r.summary["failures"])
    # each loss met the survivors between two steps: every source sent what it had walked
    # and packed while the groups formed (state_transport.prepare)
    replays = [e for e in r.events if e["event"] == "state_replayed"]
    assert len(replays) >= 4 and all(e["prepared"] for e in replays), replays
    # each joiner's spare ran to the job's end, but the one that was lost
    assert [j.returncode for j in joiners] == [1, 0, 0], [j.stderr.read() if j.stderr else "" for j in joiners]
    assert "joined as a hot spare" in r.stderr
    # the journal holds every admission: a new leader keeps them (test_restore)
    journal = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines()]
    assert [j["nodes"] for j in journal if j["action"] == "admit"] == [[n] for n in takers[1:]]
    # a join after the job ended is refused in one line
    assert "has ended (exit code 0)" in _refused(run_dir, job.env)
    assert r.final["step"] == STEPS


def test_join_usage_is_checked_before_anything_runs(tmp_path: Path) -> None:
    env = dict(os.environ)
    assert "no join.json" in _refused(tmp_path, env)
    for args, why in (
        (["--join", str(tmp_path), "--nodes", "2"], "no --nodes"),
        (["--local", "--join", str(tmp_path), "--", "python", "x.py"], "takes no command"),
        (["--local", "--join", str(tmp_path), "--inject", "kill:node0@3"], "takes no --inject"),
        (["--local"], "missing the training command"),
    ):
        p = subprocess.run(resil_run(*args, local=False), cwd=REPO, env=env, capture_output=True, text=True)
        assert p.returncode == 2 and why in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_a_joining_spare_that_fails_qualification_is_dropped_drained_and_never_gets_ranks(
    tmp_path: Path, reference: RunResult
) -> None:
    job = start_job(
        tmp_path, "--hang-timeout", "60", nodes=2, spares=0, script=f"{REPO}/tests/held_train.py {tmp_path}/release 10"
    )
    run_dir = tmp_path / "run"
    joiners: list[subprocess.Popen] = []
    try:
        _wait(job, lambda e: e["event"] == "full_strength_step", "the first step")
        # a row remap pending: the node may finish work it holds, but is given none
        joiners.append(_join(run_dir, dict(job.env, RESILD_LOCAL_NVML="set 0 remap_pending 1")))
        bad = _wait(job, lambda e: e["event"] == "node_admitted", "the first join")["node"]
        dropped = _wait(job, lambda e: e["event"] == "failure_detected" and e["node"] == bad, f"{bad} dropped")
        assert dropped["detector"] == "qualify" and "not qualified: health degraded" in dropped["cause"], dropped
        fenced = _wait(job, lambda e: e["event"] == "node_fenced" and e["node"] == bad, f"{bad} fenced")
        assert fenced["drained"], fenced  # evidence against its hardware: drained with the reason
        joiners.append(_join(run_dir, job.env))
        good = _wait(job, lambda e: e["event"] == "node_admitted" and e["node"] != bad, "the second join")["node"]
        _wait(job, lambda e: e["event"] == "worker_registered" and e["node"] == good, f"{good} warm")
        _lose(job, "local-node0")
        _wait(job, lambda e: e["event"] == "spare_assigned", "a spare takes local-node0's ranks")
        Path(f"{tmp_path}/release-10").touch()
        r = job.finish(timeout_s=180)
    finally:
        _release_and_reap(job, [tmp_path / "release-10"], joiners)
    assert r.rc == 0, r.stderr[-3000:]
    assert_bitwise_equal(reference.final, r.final)
    assert [(e["failed"], e["spare"]) for e in r.events if e["event"] == "spare_assigned"] == [("local-node0", good)]
    assert not any(e["event"] == "worker_registered" and e["node"] == bad for e in r.events)  # never started one
    assert [j.returncode for j in joiners] == [1, 0]
