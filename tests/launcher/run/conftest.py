"""Helpers for end-to-end runs of resil-run as a real process tree."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from bench.commands import resil_run, train

REPO = Path(__file__).resolve().parents[3]
TRAIN = REPO / "examples" / "train.py"
STEPS = 60


@dataclass
class RunResult:
    rc: int
    stdout: str
    stderr: str
    events: list[dict]
    summary: dict | None
    final: dict | None


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("RESILD_TEST_MARK") == mark:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@dataclass
class Started:
    """resil-run running in the background (start_job); `finish` waits and collects it."""

    p: subprocess.Popen
    tmp: Path
    mark: str
    args: tuple[str, ...]
    env: dict[str, str]

    def finish(self, timeout_s: float = 150.0) -> RunResult:
        try:
            out, err = self.p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.p.kill()
            out, err = self.p.communicate()
            kill_marked(self.mark)
            raise
        return _collect(self.tmp, self.p.returncode, out, err, self.mark, self.args)


def kill_marked(mark: str) -> list[psutil.Process]:
    """Wait a moment for the processes of a test's job to go, then kill those left."""
    deadline = time.monotonic() + 5.0
    while (left := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in left:
        proc.kill()
    return left


def _job_cmd(
    tmp: Path, args: tuple[str, ...], nodes: int, spares: int, nproc: int, steps: int, script: Path | str
) -> list[str]:
    ev, save = tmp / "events.jsonl", tmp / "final.pt"
    script_cmd = [str(script)] if isinstance(script, Path) else script.split()
    return resil_run(
        "--events",
        str(ev),
        "--run-dir",
        str(tmp / "run"),
        "--json",
        *args,
        nodes=nodes,
        spares=spares,
        nproc_per_node=nproc,
        worker=train(steps, save, script_cmd),
    )


def start_job(
    tmp: Path,
    *args: str,
    nodes: int = 3,
    spares: int = 1,
    nproc: int = 1,
    steps: int = STEPS,
    script: Path | str = TRAIN,
    env: dict[str, str] | None = None,
) -> Started:
    """resil-run in the background; `script` may be a path or 'path arg ...'."""
    mark = uuid.uuid4().hex
    tmp.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, **(env or {}), RESILD_TEST_MARK=mark, PYTHONUNBUFFERED="1")
    cmd = _job_cmd(tmp, args, nodes, spares, nproc, steps, script)
    p = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return Started(p, tmp, mark, args, full_env)


def run_job(
    tmp: Path,
    *args: str,
    nodes: int = 3,
    spares: int = 1,
    nproc: int = 1,
    steps: int = STEPS,
    timeout_s: float = 150.0,
    script: Path | str = TRAIN,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run resil-run, then assert that it left no process behind. `env`: added to the job's."""
    mark = uuid.uuid4().hex
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = _job_cmd(tmp, args, nodes, spares, nproc, steps, script)
    full_env = dict(os.environ, **(env or {}), RESILD_TEST_MARK=mark, PYTHONUNBUFFERED="1")
    p = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    return _collect(tmp, p.returncode, p.stdout, p.stderr, mark, args)


def _collect(tmp: Path, rc: int, stdout: str, stderr: str, mark: str, args: tuple[str, ...]) -> RunResult:
    left = kill_marked(mark)
    assert not left, f"orphan processes after resil-run: {[(q.pid, q.name()) for q in left]}"
    ev, save = tmp / "events.jsonl", tmp / "final.pt"
    events = [json.loads(line) for line in ev.read_text().splitlines()] if ev.exists() else []
    try:
        summary = json.loads(stdout)
    except ValueError:
        summary = None
    final = torch.load(save) if save.exists() else None
    if rc == 0:
        assert_faults_fired(args, events)
    return RunResult(rc, stdout, stderr, events, summary, final)


def assert_faults_fired(args: tuple[str, ...], events: list[dict]) -> None:
    """A job that ended well with a step fault never fired ran past it: the fault fires
    once the controller hears of the step (commit reports are batched every 0.1 s per
    stage), so a test's steps after the fault must outlast that on a loaded machine.
    Said here, by name, instead of as a later assertion on events that never came."""
    specs = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--inject"]
    fired = {str(e.get("spec", "")).replace("local-", "") for e in events if e["event"] == "fault_injected"}
    last = max((int(e.get("step", 0)) for e in events if e["event"] == "rank_done"), default=None)
    for spec in specs:
        if "@e" not in spec and spec not in fired:
            raise AssertionError(
                f"fault {spec} never fired: the job ended (last step {last}) before the controller heard of the "
                "step; give the test more steps after the fault"
            )


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """A failure-free run with the same seed and world size (2 active nodes x 1 rank)."""
    r = run_job(tmp_path_factory.mktemp("reference"))
    assert r.rc == 0, r.stderr
    return r


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] == STEPS
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), f"model tensor {k} differs"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state {i}.{k} differs"
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
