"""resild.report.goodput on synthetic event logs: every number checked against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resild.report.goodput import PHASES, EventFileError, analyze, format_breakdown, load_events, split_jobs

pytestmark = pytest.mark.timeout(30)

WORKER_CLOCK = 5000.0  # workers' CLOCK_MONOTONIC on another host: only t_log is comparable


def ev(name: str, t: float, **f) -> dict:
    return {"event": name, "t_mono": t, "t_wall": 1.7e9 + t, **f}


def wev(name: str, t: float, **f) -> dict:
    """An event a worker stamped with its own clock; the log saw it at t."""
    return {"event": name, "t_mono": t + WORKER_CLOCK, "t_wall": 1.7e9 + t, "t_log": t, **f}


def one_failure_job() -> list[dict]:
    return [
        ev("job_started", 100.0, nodes=["n0", "n1", "n2"]),
        ev("node_registered", 100.5, node="n2", role="spare"),
        ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3]}),
        wev("resumed", 109.0, node="n0", rank=0, epoch=1, step=0, seconds=0.05),
        ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),  # start-up: 10 s
        ev("progress", 112.0, step=20, epoch=1),
        ev("fault_injected", 114.0, kind="kill", node="n1", step=40, spec="kill:n1@40"),
        ev("failure_detected", 114.1, node="n1", cause="worker died", detector="process-exit", committed_step=40),
        ev("node_fenced", 114.15, node="n1", reason="worker died"),
        ev("spare_assigned", 114.16, spare="n2", failed="n1", epoch=2, ranks=[2, 3], spares_left=0),
        ev("membership", 114.17, epoch=2, layout={"n0": [0, 1], "n2": [2, 3]}),
        wev("group_reformed", 114.5, node="n0", rank=0, epoch=2, seconds=0.1, world_size=4),
        wev("resumed", 114.5, node="n0", rank=0, epoch=2, step=38, seconds=0.3),  # formed at 114.3
        wev("state_replayed", 114.55, node="n2", rank=2, epoch=2, bytes=1000, seconds=0.15, step=38),
        ev("full_strength_step", 114.6, epoch=2, step=39, rank=1),
        ev("progress", 120.0, step=100, epoch=2),
        ev("rank_done", 125.2, node="n0", rank=0, step=200),
        ev("job_finished", 125.5, reason="all 4 ranks finished", step=199, final_step=200, train_s=15.0, step_s=0.07),
    ]


def test_one_failure_every_part_and_phase():
    b = analyze(one_failure_job())
    assert b.outcome == "finished" and b.nodes == 3 and b.active_nodes == 2 and b.initial_spares == 1
    assert b.wall_s == pytest.approx(25.5)
    assert b.startup_s == pytest.approx(10.0)
    (f,) = b.failures
    assert f.kind == "node failure" and f.node == "n1" and f.fault == "kill:n1@40" and f.fault_time_from == "injected"
    # detection .1, fence .05, re-form fence→formed (114.3) .15, replay →last receiver .25, first step .05
    assert [f.phases[p] for p in PHASES] == pytest.approx([0.1, 0.05, 0.15, 0.25, 0.05])
    assert f.recovery_s == pytest.approx(0.6)
    assert (f.steps_redone, f.redone_s) == (2, pytest.approx(0.14))
    assert f.bytes_replayed == 1000 and f.spares_left == 0
    assert b.productive_s == pytest.approx(199 * 0.07)
    assert b.shutdown_s == pytest.approx(0.5)  # last commit 110 + 15 → end 125.5
    assert b.idle_s == pytest.approx(15.0 - 0.6 - 0.14 - 13.93)
    assert sum(v for _, v in b.parts()) == pytest.approx(b.wall_s)
    assert b.goodput == pytest.approx(13.93 / 25.5)
    assert b.training_goodput == pytest.approx(13.93 / 15.0)
    assert b.gpu_goodput == pytest.approx(13.93 * 2 / (25.5 * 3))  # the idle spare's GPUs are paid for too
    assert b.spares_line == [(0.0, 1), (pytest.approx(14.16), 0)]  # spare_assigned
    assert b.step_line[0] == (pytest.approx(9.0), 0) and (pytest.approx(25.0), 200) in b.step_line
    assert all(t1 <= t2 for (t1, _), (t2, _) in zip(b.step_line, b.step_line[1:]))


def test_table_and_json_carry_the_numbers():
    b = analyze(one_failure_job())
    text = format_breakdown(b)
    assert "54.6%" in text  # 13.93 / 25.5
    assert "kill:n1@40" in text and "process-exit" in text
    d = json.loads(json.dumps(b.to_dict()))
    assert d["failures"][0]["phases"]["replay"] == pytest.approx(0.25)
    assert d["startup_s"] == pytest.approx(10.0)


def test_no_spare_left_job_failed():
    evs = one_failure_job()[:9] + [ev("job_failed", 114.2, reason="no spare left: n1 failed (worker died)")]
    evs[0]["nodes"] = ["n0", "n1"]
    evs = [e for e in evs if e.get("role") != "spare"]
    b = analyze(evs)
    assert b.outcome == "failed" and b.initial_spares == 0
    (f,) = b.failures
    assert f.recovery_s is None
    assert f.phases["detection"] == pytest.approx(0.1) and f.phases["fence"] == pytest.approx(0.05)
    assert f.phases["re-form"] == f.phases["replay"] == f.phases["first step"] == 0
    assert b.shutdown_s == pytest.approx(114.2 - 114.15)
    assert sum(v for _, v in b.parts()) == pytest.approx(b.wall_s)
    assert "job failed: no spare left" in format_breakdown(b)


def test_fault_during_recovery_counts_each_second_once():
    evs = one_failure_job()
    evs[0]["nodes"] = ["n0", "n1", "n2", "n3"]
    # A second fault at 114.4 (during the first recovery) on n0; n3 takes over.
    extra = [
        ev("fault_injected", 114.4, kind="kill", node="n0", step=40, spec="kill:n0@e2"),
        ev("failure_detected", 114.45, node="n0", cause="worker died", detector="process-exit", committed_step=40),
        ev("node_fenced", 114.46, node="n0", reason="worker died"),
        ev("spare_assigned", 114.47, spare="n3", failed="n0", epoch=3, ranks=[0, 1], spares_left=0),
        ev("membership", 114.48, epoch=3, layout={"n3": [0, 1], "n2": [2, 3]}),
        wev("group_reformed", 114.9, node="n3", rank=0, epoch=3, seconds=0.1, world_size=4),
        wev("resumed", 114.9, node="n3", rank=0, epoch=3, step=38, seconds=0.3),
        ev("full_strength_step", 115.0, epoch=3, step=39, rank=1),
    ]
    evs = [e for e in evs if not (e["event"] == "full_strength_step" and e["epoch"] == 2)]
    evs = sorted(evs + extra, key=lambda e: e.get("t_log", e["t_mono"]))
    b = analyze(evs)
    f1, f2 = b.failures
    assert f1.overlapped and not f2.overlapped
    assert sum(f1.phases.values()) == pytest.approx(0.4)  # cut at the second fault
    assert sum(f2.phases.values()) == pytest.approx(0.6)
    assert b.recovery_s == pytest.approx(115.0 - 114.0)


def test_spare_failure_does_not_stop_training():
    evs = one_failure_job()
    evs.insert(6, ev("failure_detected", 113.0, node="n2", cause="Xid 79", detector="nvml-xid", committed_step=30))
    evs.insert(7, ev("node_fenced", 113.01, node="n2", reason="Xid 79"))
    b = analyze(evs)
    assert b.failures[0].kind == "spare lost" and b.failures[0].phases == {}
    assert b.spares_line == [(0.0, 1), (pytest.approx(13.01), 0)]


def test_unknown_fault_time_falls_back_to_first_collective_failure():
    evs = [e for e in one_failure_job() if e["event"] != "fault_injected"]
    evs.insert(6, ev("collective_failed", 113.9, rank=0, epoch=1, error="Connection reset"))
    (f,) = analyze(evs).failures
    assert f.fault_time_from == "collective failure"
    assert f.phases["detection"] == pytest.approx(0.2)


def test_several_jobs_in_one_file(tmp_path: Path):
    first = one_failure_job()
    second = [
        dict(e, t_mono=e["t_mono"] + 1000, **({"t_log": e["t_log"] + 1000} if "t_log" in e else {}))
        for e in one_failure_job()
    ]
    assert len(split_jobs(first + second)) == 2
    assert analyze(first + second).job_index == 2
    assert analyze(first + second, job=1).failures[0].t_fault == pytest.approx(14.0)
    with pytest.raises(EventFileError, match="no job 3"):
        analyze(first + second, job=3)


def test_no_job_finished_yet_uses_progress_rate():
    evs = [e for e in one_failure_job() if e["event"] not in ("job_finished", "rank_done")]
    b = analyze(evs)
    assert b.outcome == "incomplete"
    # Only one same-epoch pair of progress points with a step advance: none (epochs differ), so
    # the rate comes from nowhere and productive time is not invented.
    assert b.step_s is None and b.productive_s == 0.0
    evs.append(ev("progress", 121.0, step=110, epoch=2))
    assert analyze(evs).step_s == pytest.approx(0.1)


def test_step_time_is_the_smaller_estimate():
    # The controller's median (0.07) wins over the progress windows (10 steps in 1 s = 0.1)...
    evs = one_failure_job()
    evs.insert(-2, ev("progress", 121.0, step=110, epoch=2))
    assert analyze(evs).step_s == pytest.approx(0.07)
    # ...unless aggregated commit reports left it only slow pairs (0.25 > 0.1).
    evs[-1] = dict(evs[-1], step_s=0.25)
    assert analyze(evs).step_s == pytest.approx(0.1)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "e.jsonl"
    p.write_text(text)
    return p


def test_load_errors_are_one_line(tmp_path: Path):
    with pytest.raises(EventFileError, match="no such file"):
        load_events(tmp_path / "missing.jsonl")
    with pytest.raises(EventFileError, match="empty"):
        load_events(write(tmp_path, "\n\n"))
    with pytest.raises(EventFileError, match=r"e.jsonl:2: not JSON"):
        load_events(write(tmp_path, '{"event":"a","t_mono":1}\n{oops\n{"event":"b","t_mono":2}\n'))
    with pytest.raises(EventFileError, match=r":1: not a resild event"):
        load_events(write(tmp_path, "[1, 2]\n"))
    with pytest.raises(EventFileError, match="not a text file"):
        p = tmp_path / "bin.jsonl"
        p.write_bytes(b"\xff\xfe\x00garbage")
        load_events(p)
    # A log still being written: a partial last line is ignored.
    evs = load_events(write(tmp_path, '{"event":"a","t_mono":1}\n{"event":"b","t_mo'))
    assert [e["event"] for e in evs] == ["a"]


def test_what_became_of_the_disk_checkpoints_is_counted_and_said():
    events = one_failure_job()[:-1] + [
        wev("checkpoint_saved", 111.0, node="n0", rank=0, epoch=1, step=10, seconds=0.1, bytes=100),
        wev("checkpoint_failed", 114.3, node="n0", rank=0, epoch=2, step=40, abandoned=True, error="StaleEpoch: x"),
        wev("checkpoint_deferred", 115.0, node="n0", rank=0, epoch=2, step=50, due=50, reason="1 rank(s) still"),
        wev("checkpoint_failed", 116.0, node="n0", rank=0, epoch=2, step=60, abandoned=False, error="OSError: full"),
        wev("checkpoint_saved", 117.0, node="n0", rank=0, epoch=2, step=70, seconds=0.1, bytes=100),
        one_failure_job()[-1],
    ]
    b = analyze(events)
    assert b.checkpoints == {
        "saved": 2,
        "failed": 1,
        "abandoned": 1,
        "deferred": 1,
        "loaded": 0,
        "last_saved_step": 70,
        "last_error": "OSError: full",
    }
    assert (
        "disk checkpoints: 2 saved (newest step 70), 1 failed, 1 abandoned by a recovery, 1 deferred; "
        "last error: OSError: full"
    ) in format_breakdown(b)
    assert analyze(one_failure_job()).checkpoints is None  # no checkpoint: no line
    assert "disk checkpoints" not in format_breakdown(analyze(one_failure_job()))


def test_the_spares_line_rises_when_a_spare_joins_or_comes_back():
    events = one_failure_job()
    at = next(i for i, e in enumerate(events) if e["event"] == "progress" and e["step"] == 100)
    events[at:at] = [
        ev("node_admitted", 116.0, node="j0", via="join", source="local", spares=1),
        ev("node_readmitted", 118.0, node="n1", reason="fenced without evidence", spares=2),
    ]
    b = analyze(events)
    assert b.spares_line == [(0.0, 1), (pytest.approx(14.16), 0), (pytest.approx(16.0), 1), (pytest.approx(18.0), 2)]


def test_the_pool_over_time_hot_and_queued_through_a_shrink_and_a_grow():
    from tests.launcher.run.test_status import shrunk_then_grown

    b = analyze(shrunk_then_grown())
    # no hot spare at the start; n9 joins from the queue (1), the grow takes it (0)
    assert b.spares_line == [(0.0, 0), (pytest.approx(18.0), 1), (pytest.approx(20.0), 0)]
    assert b.queued_line == [(pytest.approx(14.2), 1), (pytest.approx(18.0), 0)]
    text = format_breakdown(b)
    assert "hot spares over time: 0 at 0.0s, 1 at 18.0s, 0 at 20.0s; cold spares queued: 1 at 14.2s, 0 at 18.0s" in text
    assert b.to_dict()["queued_line"] == [[14.2, 1], [18.0, 0]]


def shrunk_while_joined_spares_start() -> list[dict]:
    """j0 and j1 join but are still starting (no ranks for them yet) when n1 dies: the job
    shrinks with both in the pool; j0 then grows it back to full width, j1 stays a spare."""
    return [
        ev("job_started", 100.0, nodes=["n0", "n1"]),
        ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3]}),
        ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
        ev("progress", 112.0, step=20, epoch=1),
        ev("node_admitted", 113.0, node="j0", via="join", source="local", spares=1),
        ev("node_admitted", 113.5, node="j1", via="join", source="local", spares=2),
        ev("failure_detected", 114.1, node="n1", cause="worker died", detector="process-exit", committed_step=40),
        ev("node_fenced", 114.15, node="n1", reason="worker died"),
        ev("job_resized", 114.16, how="shrink", node="n1", epoch=2, world_size=2, was=4, full=4, spares_left=2),
        ev("membership", 114.17, epoch=2, layout={"n0": [0, 1]}),
        wev("resumed", 114.5, node="n0", rank=0, epoch=2, step=40, seconds=0.2),
        ev("full_strength_step", 114.6, epoch=2, step=41, rank=0),
        ev("job_resized", 116.0, how="grow", node="j0", epoch=3, world_size=4, was=2, full=4, spares_left=1),
        ev("membership", 116.01, epoch=3, layout={"n0": [0, 1], "j0": [2, 3]}),
        ev("full_strength_step", 116.5, epoch=3, step=60, rank=0),
        ev("job_finished", 125.5, reason="all 4 ranks finished", step=199, final_step=200, train_s=15.0, step_s=0.07),
    ]


def test_a_grow_takes_its_node_out_of_the_pool_and_a_shrink_none():
    b = analyze(shrunk_while_joined_spares_start())
    # 0 at the start; j0 and j1 join (1, 2); the shrink spends no spare; the grow takes j0 (1)
    assert b.spares_line == [(0.0, 0), (pytest.approx(13.0), 1), (pytest.approx(13.5), 2), (pytest.approx(16.0), 1)]
    assert "hot spares over time: 0 at 0.0s, 1 at 13.0s, 2 at 13.5s, 1 at 16.0s" in format_breakdown(b)
    (f,) = b.failures  # the grow is no failure
    assert (f.kind, f.node, f.spares_left, f.steps_redone) == ("node failure", "n1", 2, 0)
    assert f.recovery_s == pytest.approx(0.5)


def test_a_start_up_spare_that_grows_the_job_leaves_the_pool():
    # n2, a start-up spare, had not registered when n1 died: the job shrank, n2 grew it back
    events = [e for e in shrunk_while_joined_spares_start() if e["event"] != "node_admitted"]
    events[0] = ev("job_started", 100.0, nodes=["n0", "n1", "n2"])
    for e in events:
        if e["event"] == "job_resized" and e["how"] == "grow":
            e["node"] = "n2"
    b = analyze(events)
    assert b.initial_spares == 1
    assert b.spares_line == [(0.0, 1), (pytest.approx(16.0), 0)]
