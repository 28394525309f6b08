"""Live status of resil-run: the StatusLine listener, the event log's throttle and listeners,
--quiet wiring, the Slurm --no-kill warning, and one real local job end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.commands import resil_run, train
from launcher.run.slurm_mode import (
    allocation_survives_node_failure,
    no_kill_from_job_json,
    no_kill_from_script,
    warn_if_allocation_dies_with_a_node,
)
from launcher.run.status import StatusLine
from resild.events.log import EventLog

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ev(name: str, t: float, **f) -> dict:
    return {"event": name, "t_mono": t, **f}


def feed(line: StatusLine, clock: Clock, events: list[dict]) -> None:
    for e in events:
        clock.t = e["t_mono"]
        line(e)


def test_a_new_controller_leader_is_shown() -> None:
    out, clock = io.StringIO(), Clock()
    line = StatusLine(out, tty=False, clock=clock)
    feed(
        line,
        clock,
        [
            ev("controller_leader", 0.0, index=0, pid=11, host="n1", term=1, restored=0),
            ev("job_started", 0.1, nodes=["a", "b"]),
            ev("controller_leader", 9.0, index=2, pid=13, host="n3", term=3, restored=7),
        ],
    )
    assert out.getvalue().splitlines() == [
        "resil-run: controller replica 0 leads (pid 11 on n1, term 1)",
        "resil-run: [    8.9s] controller replica 0 lost; replica 2 leads now (pid 13 on n3, term 3, "
        "7 journal records restored)",
    ]


JOB = [
    ev("job_started", 0.0, nodes=["a", "b", "c", "d"]),
    ev("worker_registered", 10.0, node="a", local_rank=0),
    ev("worker_registered", 11.0, node="a", local_rank=1),  # within 5 s: not printed
    ev("membership", 20.0, epoch=1, layout={"a": [0, 1], "b": [2, 3]}),
    ev("progress", 21.0, step=10, epoch=1),
    ev("progress", 21.5, step=20, epoch=1),  # 20 steps/s; too soon to print (every 5 s)
    ev("progress", 26.5, step=120, epoch=1),  # 5 s later: printed
    ev("fault_injected", 27.0, node="b", spec="kill:b@130"),
    ev(
        "failure_detected",
        27.03,
        node="b",
        cause="b failed: worker 0 exited with signal 9",
        detector="process-exit",
        committed_step=130,
    ),
    ev("spare_assigned", 27.04, spare="c", failed="b", epoch=2, spares_left=1),
    ev("membership", 27.05, epoch=2, layout={"a": [0, 1], "c": [2, 3]}),
    ev("full_strength_step", 27.25, epoch=2, step=131),
    ev("failure_detected", 28.0, node="d", cause="d failed: Xid 79", detector="nvml-xid", committed_step=140),
    ev("progress", 33.0, step=240, epoch=2),
]


def test_status_line_says_what_matters():
    out, clock = io.StringIO(), Clock()
    feed(StatusLine(out, every_s=5.0, tty=False, clock=clock), clock, JOB)
    lines = out.getvalue().splitlines()
    assert lines.pop(0) == "resil-run: [   10.0s] starting: 1 workers ready on 4 nodes"
    assert lines[0] == "resil-run: [   20.0s] training started: 2 nodes, 4 ranks, 2 hot spares"
    # 21.0 and 21.5: within 5 s of the last line; 26.5: rate from the last two points
    assert lines[1] == "resil-run: [   26.5s] step 120 (20.0 steps/s), epoch 1, spares 2/2"
    assert "failure: b failed: worker 0 exited with signal 9 [process-exit] at step 130" in lines[2]
    assert "c takes over b's ranks (epoch 2), 1 spare(s) left" in lines[3]
    assert "back at full strength at step 131, 0.25s after the fault" in lines[4]
    assert "hot spare d lost: d failed: Xid 79; 0 spare(s) left" in lines[5]
    assert lines[6].endswith(
        "step 240 (20.0 steps/s), epoch 2, spares 0/2, last failure: b (process-exit) recovered in 0.25s"
    )
    assert len(lines) == 7


def test_status_line_on_a_terminal_rewrites_in_place():
    out, clock = io.StringIO(), Clock()
    line = StatusLine(out, every_s=0.0, tty=True, clock=clock)
    feed(line, clock, JOB[:1] + JOB[3:6])
    text = out.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.endswith("epoch 1, spares 2/2")  # last line left open
    line.close()
    assert out.getvalue().endswith("\n")


def test_event_log_throttles_progress_and_isolates_listeners(tmp_path: Path):
    log = EventLog(tmp_path / "e.jsonl", progress_interval_s=3600)
    seen: list[str] = []
    log.listeners.append(lambda r: seen.append(r["event"]))
    log.listeners.append(lambda r: 1 / 0)  # a broken display must not break the job
    assert log.progress(1, 1) is not None
    assert log.progress(2, 1) is None  # within the interval
    log.emit("resumed", t_mono=123.0, step=1)
    log.close()
    assert seen == ["progress", "resumed"] and len(log.listeners) == 1
    assert [r["event"] for r in log.records] == ["resumed"]  # progress: file, listeners, the latest only
    assert [r["step"] for r in log.recent_progress] == [1]
    recs = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r["event"] for r in recs] == ["progress", "resumed"]
    assert recs[1]["t_mono"] == 123.0 and recs[1]["t_log"] > 0  # the sender's clock kept, the log's added


def test_quiet_turns_the_status_off(monkeypatch):
    import launcher.run.job
    from launcher.run.cli import main

    got = {}

    def fake_run_job(spec, as_json=False, status=True, **kw):
        got["status"] = status
        return 0

    monkeypatch.setattr(launcher.run.job, "run_job", fake_run_job)
    for args, want in ((["--quiet"], False), ([], True)):
        r = CliRunner().invoke(main, ["--local", *args, "--", "true"])
        assert r.exit_code == 0 and got["status"] is want


# ---- Slurm: say at start when a node failure will cancel the allocation ----------------------
SCRIPT = "#!/bin/bash\n#SBATCH -N 5\n{directive}\n\nresil-run --spares 1 -- python train.py\n#SBATCH --no-kill\n"


@pytest.mark.parametrize(
    "directive,want",
    [
        ("#SBATCH --no-kill", True),
        ("#SBATCH -k", True),
        ("#SBATCH --no-kill=off", False),
        ("#SBATCH --time=1:00:00  # no kill here", None),
        ("", None),
    ],
)
def test_no_kill_from_script_reads_directives_before_the_first_command(directive, want):
    assert no_kill_from_script(SCRIPT.format(directive=directive)) is want


def test_no_kill_sources_in_order():
    def runner(outputs: dict):
        return lambda argv: outputs.get(" ".join(argv[:4]))

    json_says = runner({"scontrol show job --json": json.dumps({"jobs": [{"kill_on_node_fail": True}]})})
    assert allocation_survives_node_failure("7", {}, json_says) == (False, "scontrol show job --json")
    assert no_kill_from_job_json(json.dumps({"jobs": [{"kill_on_node_fail": False}]})) is True
    submit = runner({"scontrol show job 7": "JobId=7\n   SubmitLine=sbatch -k -N 5 job.sh\n"})
    assert allocation_survives_node_failure("7", {}, submit) == (True, "the submit line")
    # Slurm 22.05 (checked on the lab): no JSON, no SubmitLine; `sbatch -k` leaves no trace,
    # so a script without the directive cannot tell us "no".
    script = runner({"scontrol write batch_script 7": SCRIPT.format(directive="")})
    assert allocation_survives_node_failure("7", {}, script)[0] is None
    assert allocation_survives_node_failure("7", {"SBATCH_NO_KILL": "1"}, script)[0] is True
    with_submit = runner(
        {
            "scontrol write batch_script 7": SCRIPT.format(directive=""),
            "scontrol show job 7": "JobId=7\n   SubmitLine=sbatch -N 5 job.sh\n",
        }
    )
    assert allocation_survives_node_failure("7", {}, with_submit)[0] is False
    assert allocation_survives_node_failure("7", {}, runner({}))[0] is None


def test_warning_printed_at_start():
    out = io.StringIO()
    script = {"scontrol write batch_script 42 -": "#!/bin/bash\n#SBATCH -N 3\n#SBATCH --no-kill=off\nsrun true\n"}
    assert warn_if_allocation_dies_with_a_node("42", {}, out, run=lambda a: script.get(" ".join(a))) is False
    assert "job 42 was not submitted with --no-kill" in out.getvalue()
    out = io.StringIO()
    assert warn_if_allocation_dies_with_a_node("42", {}, out, run=lambda a: None) is None
    assert "could not tell whether job 42 has --no-kill" in out.getvalue()
    out = io.StringIO()
    ok = {"scontrol write batch_script 42 -": "#!/bin/bash\n#SBATCH --no-kill\nsrun true\n"}
    assert warn_if_allocation_dies_with_a_node("42", {}, out, run=lambda a: ok.get(" ".join(a))) is True
    assert out.getvalue() == ""


# ---- one real job: status on stderr, clean JSON on stdout, a report from its events -------------
@pytest.mark.timeout(300)
def test_real_local_job_status_json_and_report(tmp_path: Path):
    events = tmp_path / "events.jsonl"
    r = subprocess.run(
        resil_run(
            "--events",
            str(events),
            "--json",
            "--inject",
            "kill:node1@30",
            nodes=3,
            spares=1,
            nproc_per_node=1,
            worker=train(80, script=REPO / "examples/train.py"),
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # workers import this tree's launcher, not another checkout
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)  # nothing but the JSON on stdout
    assert summary["exit_code"] == 0
    assert "resil-run: " in r.stderr and "training started: 2 nodes, 2 ranks, 1 hot spares" in r.stderr
    assert "failure: local-node1 failed" in r.stderr and "back at full strength" in r.stderr

    from resild.report.goodput import PHASES, analyze, load_events

    b = analyze(load_events(events))
    # steps counts commits after the first one the controller saw (node processes may aggregate
    # progress reports, so the first seen can be step 2 or 3)
    assert b.outcome == "finished" and 70 <= b.steps <= 79
    assert any(e["event"] == "progress" for e in load_events(events))
    (f,) = b.failures
    assert f.fault == "kill:local-node1@30" and f.recovery_s is not None and 0 < f.recovery_s < 10
    assert all(f.phases[p] >= 0 for p in PHASES) and f.phases["detection"] > 0
    assert sum(f.phases.values()) == pytest.approx(f.recovery_s)
    assert sum(v for _, v in b.parts()) == pytest.approx(b.wall_s, rel=1e-6)
    assert b.step_line[-1][1] == 80


def test_end_of_run_goodput_survives_aggregated_commit_reports():
    from launcher.run.status import summarize

    progress = [ev("progress", 100.0 + 0.5 * k, step=10 * k, epoch=1) for k in range(5)]  # 0.05 s a step
    # The controller only saw consecutive commits for slow steps: its median says 0.1 s.
    fin = ev("job_finished", 102.5, reason="done", step=40, final_step=40, train_s=2.5, step_s=0.1)
    _, job = summarize([fin] + progress)
    assert job["step_s"] == pytest.approx(0.05)
    assert job["goodput"] == pytest.approx(40 * 0.05 / 2.5)  # not min(1, 40 x 0.1 / 2.5) = 100%
