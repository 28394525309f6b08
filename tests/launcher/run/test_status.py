"""resil-run's end-of-run table and `resild report` read the same events file the same way.

Each case is a file that the two analyzers read differently before they shared
resild.report.recoveries (noted per case); `one_failure` agreed all along."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from launcher.run.status import StatusLine, format_table, summarize
from resild.events.log import read_events
from resild.report.goodput import analyze, format_breakdown, load_events

pytestmark = pytest.mark.timeout(30)

WORKER_CLOCK = 5000.0  # a worker's CLOCK_MONOTONIC on another host: only t_log is comparable


def ev(name: str, t: float, **f: Any) -> dict[str, Any]:
    return {"event": name, "t_mono": t, "t_wall": 1.7e9 + t, **f}


def wev(name: str, t: float, **f: Any) -> dict[str, Any]:
    return {"event": name, "t_mono": t + WORKER_CLOCK, "t_wall": 1.7e9 + t, "t_log": t, **f}


def start() -> list[dict[str, Any]]:
    return [
        ev("job_started", 100.0, nodes=["n0", "n1", "n2", "n3"]),
        ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3]}),
        ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
        ev("progress", 112.0, step=20, epoch=1),
    ]


def finish(t: float) -> list[dict[str, Any]]:
    return [
        ev("progress", t - 1.0, step=180, epoch=9),
        ev("job_finished", t, reason="all 4 ranks finished", step=199, final_step=200, train_s=15.0, step_s=0.07),
    ]


def replaced(t: float, failed: str, spare: str, epoch: int, committed: int, resumed: int, **fault: Any) -> list:
    """An injected fault (unless fault=None) on `failed`, `spare` takes over in `epoch`."""
    out = []
    if fault.get("spec", "") is not None:
        out.append(ev("fault_injected", t, kind="kill", node=failed, step=committed, spec=f"kill:{failed}@{committed}"))
    out += [
        ev(
            "failure_detected",
            t + 0.1,
            node=failed,
            cause="worker died",
            detector="process-exit",
            committed_step=committed,
        ),
        ev("node_fenced", t + 0.15, node=failed, reason="worker died"),
        ev("spare_assigned", t + 0.16, spare=spare, failed=failed, epoch=epoch, ranks=[2, 3], spares_left=0),
        ev("membership", t + 0.17, epoch=epoch, layout={"n0": [0, 1], spare: [2, 3]}),
        wev("group_reformed", t + 0.5, node="n0", rank=0, epoch=epoch, seconds=0.1, world_size=4),
        wev("resumed", t + 0.5, node="n0", rank=0, epoch=epoch, step=resumed, seconds=0.3),
        wev("state_replayed", t + 0.55, node=spare, rank=2, epoch=epoch, bytes=1000, seconds=0.15, step=resumed),
        ev("full_strength_step", t + 0.6, epoch=epoch, step=resumed + 1, rank=1),
    ]
    return out


def one_failure() -> list[dict[str, Any]]:
    return start() + replaced(114.0, "n1", "n2", 2, 40, 38) + finish(125.5)


def transient_reform() -> list[dict[str, Any]]:
    # Old table: "no failures" (it read only failure_detected); the report: one re-form.
    return (
        start()
        + [
            ev("collective_failed", 113.9, rank=2, epoch=1, error="Connection reset by peer"),
            ev("reform", 114.2, epoch=2, reason="a collective failed in epoch 1 but every node answered"),
            ev("membership", 114.21, epoch=2, layout={"n0": [0, 1], "n1": [2, 3]}),
            wev("group_reformed", 114.4, node="n0", rank=0, epoch=2, seconds=0.1, world_size=4),
            wev("resumed", 114.4, node="n0", rank=0, epoch=2, step=38, seconds=0.2),
            ev("full_strength_step", 114.5, epoch=2, step=39, rank=0),
        ]
        + finish(125.5)
    )


def real_failure_seen_first_as_a_collective_failure() -> list[dict[str, Any]]:
    # Nothing injected. Old table: recovery from the detection (0.5 s), detect "-";
    # the report: from the first collective failure (0.7 s).
    evs = [e for e in one_failure() if e["event"] != "fault_injected"]
    evs.insert(4, ev("collective_failed", 113.9, rank=0, epoch=1, error="Connection reset by peer"))
    return evs


def fault_during_recovery() -> list[dict[str, Any]]:
    # n1 dies; during its recovery n0 dies too, n3 takes over in epoch 3. Epoch 2 never
    # resumes. Old table: the first failure lost 2 steps (epoch 3's resume, counted for
    # both failures); the report: 0 (and 2 for the second).
    first = [e for e in replaced(114.0, "n1", "n2", 2, 40, 38) if e.get("epoch") != 2 or e["event"] == "spare_assigned"]
    first.append(ev("membership", 114.17, epoch=2, layout={"n0": [0, 1], "n2": [2, 3]}))
    second = replaced(114.4, "n0", "n3", 3, 40, 38)
    return sorted(start() + first + second + finish(125.5), key=lambda e: e.get("t_log", e["t_mono"]))


def spare_lost_and_no_spare_left() -> list[dict[str, Any]]:
    return start() + [
        ev("failure_detected", 113.0, node="n3", cause="Xid 79", detector="nvml-xid", committed_step=30),
        ev("node_fenced", 113.01, node="n3", reason="Xid 79"),
        ev("fault_injected", 114.0, kind="kill", node="n1", step=40, spec="kill:n1@40"),
        ev("failure_detected", 114.1, node="n1", cause="worker died", detector="process-exit", committed_step=40),
        ev("node_fenced", 114.15, node="n1", reason="worker died"),
        ev("job_failed", 114.2, reason="no spare left: n1 failed (worker died)"),
    ]


def replaced_before_start() -> list[dict[str, Any]]:
    # n1 fails before the first epoch; n2 takes its place in epoch 1. Old report: a "spare
    # lost" with no recovery time; old table: recovered at the first step. Both now: "before
    # start", recovered at the first full-strength step, its time counted in start-up.
    return [
        ev("job_started", 100.0, nodes=["n0", "n1", "n2"]),
        ev("fault_injected", 100.5, kind="kill", node="n1", step=0, spec="kill:n1@0"),
        ev("failure_detected", 100.6, node="n1", cause="worker died", detector="process-exit", committed_step=0),
        ev("node_fenced", 100.61, node="n1", reason="worker died"),
        ev("spare_assigned", 100.62, spare="n2", failed="n1", epoch=1, ranks=[2, 3], spares_left=0, before_start=True),
        ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n2": [2, 3]}),
        ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
        ev("progress", 112.0, step=20, epoch=1),
    ] + finish(125.5)


CASES = {
    "replaced before start": replaced_before_start,
    "one failure": one_failure,
    "transient re-form": transient_reform,
    "fault time from a collective failure": real_failure_seen_first_as_a_collective_failure,
    "fault during recovery": fault_during_recovery,
    "spare lost, then no spare left": spare_lost_and_no_spare_left,
}


def write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_end_of_run_table_and_report_agree_on_recoveries(tmp_path: Path, case: str) -> None:
    path = write(tmp_path / "events.jsonl", CASES[case]())
    table, _ = summarize(read_events(path))  # as resil-run --standby reads it back; the same records
    report = analyze(load_events(path)).failures
    assert len(table) == len(report), (table, report)
    for t, r in zip(table, report):
        assert (t.node, t.fault, t.detector, t.cause) == (r.node, r.fault, r.detector, r.cause)
        assert t.recovery_s == (None if r.recovery_s is None else pytest.approx(r.recovery_s))
        assert (t.steps_lost or 0) == r.steps_redone
        assert t.bytes_replayed == r.bytes_replayed
        if r.fault_time_from == "detection":
            assert t.detect_s is None
        elif r.phases:
            assert t.detect_s == pytest.approx(r.phases["detection"])


def test_a_reform_is_a_row_of_the_table() -> None:
    failures, job = summarize(transient_reform())
    (f,) = failures
    assert f.node is None and f.detector == "probe" and f.recovery_s == pytest.approx(0.6)
    # The reform event carries no committed step: steps redone are not known (None; the report's 0).
    assert f.detect_s == pytest.approx(0.3) and f.steps_lost is None
    text = format_table(failures, job)
    assert "no failures" not in text
    assert text.splitlines()[1].startswith(" 1 -             -                      probe")


def test_table_text_for_one_failure() -> None:
    failures, job = summarize(one_failure())
    assert format_table(failures, job).splitlines() == [
        " # node          fault                  detector        detect  recovery redone from       replayed  cause",
        " 1 n1            kill:n1@40             process-exit    0.100s    0.600s      2 -             0.0MB  "
        "worker died",
        "steps 199, median step 70.0ms, training wall 15.00s, goodput 92.9%",
    ]
    assert "kill:n1@40" in format_breakdown(analyze(one_failure()))


def test_state_resild_cannot_vouch_for_is_one_line_of_the_table_and_the_report() -> None:
    why = "replicas diverged at step 80 before any fingerprint compare had agreed"
    said = ev("state_unvouched", 10.0, step=80, reason=why)
    for evs in (
        [*one_failure(), said],
        [{**e, "unvouched": why} if e["event"] == "job_finished" else e for e in one_failure()],
    ):
        failures, job = summarize(evs)
        assert job["unvouched"] == why
        line = f"WARNING: resild cannot vouch for this job's final state: {why}"
        assert format_table(failures, job).splitlines()[-1] == line
        assert line in format_breakdown(analyze(evs)).splitlines()
    assert "unvouched" not in summarize(one_failure())[1]
    assert "cannot vouch" not in format_breakdown(analyze(one_failure()))


def test_summarize_tolerates_malformed_events() -> None:
    evs: list[dict[str, Any]] = [
        {},
        {"event": 3},
        {"event": "failure_detected"},  # no time
        {"event": "failure_detected", "t_mono": "soon", "node": "n1"},
        {"event": "spare_assigned", "t_mono": 1.0, "epoch": "two"},
        {"event": "job_finished", "t_mono": 2.0},  # no step, no train_s
        {"event": "progress", "t_mono": 1.5, "step": None},
        {"event": "some_future_event", "t_mono": 1.0, "x": [1]},
        {"event": "worker.custom", "t_mono": 1.0},
        ev("failure_detected", 3.0, node="n1", committed_step="x"),
    ]
    failures, job = summarize(evs)
    assert [f.node for f in failures] == ["n1"] and failures[0].steps_lost is None
    assert job == {}
    format_table(failures, job)


def live(events: list[dict[str, Any]]) -> tuple[StatusLine, list[str]]:
    out = io.StringIO()
    line = StatusLine(out, every_s=1e9, tty=False, clock=lambda: 0.0)
    for e in events:
        line(e)
    return line, out.getvalue().splitlines()


@pytest.mark.parametrize("case", ["one failure", "transient re-form", "fault time from a collective failure"])
def test_live_status_line_reports_the_tables_recovery_time(case: str) -> None:
    events = CASES[case]()
    (f,) = summarize(events)[0]
    line, lines = live(events)
    assert f.recovery_s is not None
    back = [s for s in lines if "back at full strength" in s]
    assert back and back[-1].endswith(f", {f.recovery_s:.2f}s after the fault")
    assert line.status().endswith(f"recovered in {f.recovery_s:.2f}s")


def test_live_status_line_shows_a_reform_while_it_recovers() -> None:
    events = transient_reform()
    line, _ = live(events[: [e["event"] for e in events].index("reform") + 1])
    assert line.status().endswith("recovering from re-form")


def shrunk_then_grown() -> list[dict[str, Any]]:
    """No spare: n1 lost, the job shrinks to 2 ranks in epoch 2 and asks the queue for a cold
    spare; it joins (n9, slurm:77) and the job grows back in epoch 3."""
    return (
        [
            ev("job_started", 100.0, nodes=["n0", "n1"]),
            ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3]}),
            ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
            ev("progress", 112.0, step=20, epoch=1),
        ]
        + [e for e in replaced(114.0, "n1", "-", 2, 40, 40) if e["event"] not in ("spare_assigned", "state_replayed")]
        + [
            ev("job_resized", 114.16, how="shrink", node="n1", epoch=2, world_size=2, was=4, full=4, spares_left=0),
            ev("spares_requested", 114.2, count=1, reason="the pool is below --spare-target 1"),
            ev("node_admitted", 118.0, node="n9", via="join", source="slurm:77", spares=1),
            ev("job_resized", 120.0, how="grow", node="n9", epoch=3, world_size=4, was=2, full=4, spares_left=0),
            ev("full_strength_step", 120.5, epoch=3, step=60, rank=0),
        ]
        + finish(125.5)
    )


def test_live_status_line_follows_a_shrink_the_queue_and_a_grow() -> None:
    events = shrunk_then_grown()
    line, lines = live(events[: [e["event"] for e in events].index("spares_requested") + 1])
    assert any("no spare left: the job shrinks to 2 ranks (epoch 2)" in s for s in lines), lines
    assert ", spares 0/0 (+1 queued), shrunk to 2/4 ranks" in line.status()
    line, lines = live(events)
    assert any("n9 joins: the job grows to 4 ranks (epoch 3)" in s for s in lines), lines
    assert "queued" not in line.status() and "shrunk" not in line.status()


def shrunk_twice_then_grown_twice() -> list[dict[str, Any]]:
    """Three nodes, no spare: n1 then n2 lost (6 -> 4 -> 2 ranks), then j0 and j1 join from the
    queue one at a time and grow the job back (2 -> 4 -> 6 ranks)."""

    def lost(t: float, node: str, epoch: int, world: int, layout: dict[str, list[int]], step: int) -> list:
        return [
            ev("failure_detected", t, node=node, cause="worker died", detector="process-exit", committed_step=step),
            ev("node_fenced", t + 0.05, node=node, reason="worker died"),
            ev(
                "job_resized",
                t + 0.06,
                how="shrink",
                node=node,
                epoch=epoch,
                world_size=world,
                was=world + 2,
                full=6,
                spares_left=0,
            ),
            ev("membership", t + 0.07, epoch=epoch, layout=layout),
            wev("resumed", t + 0.3, node="n0", rank=0, epoch=epoch, step=step, seconds=0.2),
            ev("full_strength_step", t + 0.5, epoch=epoch, step=step + 1, rank=0),
        ]

    def joins(t: float, node: str, epoch: int, world: int, layout: dict[str, list[int]]) -> list:
        return [
            ev("node_admitted", t, node=node, via="join", source="slurm:77", spares=1),
            ev(
                "job_resized",
                t + 1.0,
                how="grow",
                node=node,
                epoch=epoch,
                world_size=world,
                was=world - 2,
                full=6,
                spares_left=0,
            ),
            ev("membership", t + 1.01, epoch=epoch, layout=layout),
            ev("full_strength_step", t + 1.5, epoch=epoch, step=10 * epoch, rank=0),
        ]

    return (
        [
            ev("job_started", 100.0, nodes=["n0", "n1", "n2"]),
            ev("membership", 101.0, epoch=1, layout={"n0": [0, 1], "n1": [2, 3], "n2": [4, 5]}),
            ev("full_strength_step", 110.0, epoch=1, step=1, rank=0),
        ]
        + lost(114.0, "n1", 2, 4, {"n0": [0, 1], "n2": [2, 3]}, 40)
        + lost(115.0, "n2", 3, 2, {"n0": [0, 1]}, 45)
        + [ev("spares_requested", 115.2, count=2, reason="the pool is below --spare-target 1")]
        + joins(118.0, "j0", 4, 4, {"n0": [0, 1], "j0": [2, 3]})
        + joins(121.0, "j1", 5, 6, {"n0": [0, 1], "j0": [2, 3], "j1": [4, 5]})
    )


def test_live_status_line_says_every_resize_and_the_width_between() -> None:
    events = shrunk_twice_then_grown_twice()
    names = [e["event"] for e in events]
    _, lines = live(events)
    assert [s for s in lines if " shrinks to " in s or " grows to " in s] == [
        "resil-run: [   14.1s] no spare left: the job shrinks to 4 ranks (epoch 2)",
        "resil-run: [   15.1s] no spare left: the job shrinks to 2 ranks (epoch 3)",
        "resil-run: [   19.0s] j0 joins: the job grows to 4 ranks (epoch 4)",
        "resil-run: [   22.0s] j1 joins: the job grows to 6 ranks (epoch 5)",
    ]
    # a shrink is a recovery: back at full strength (of its width) at the shrink's first step
    assert "resil-run: [   14.5s] back at full strength at step 41, 0.50s after the fault" in lines
    line, _ = live(events[: names.index("full_strength_step", names.index("node_admitted"))])
    assert line.status() == (
        "step 46 (- steps/s), epoch 4, spares 0/0 (+1 queued), shrunk to 4/6 ranks, "
        "last failure: n2 (process-exit) recovered in 0.50s"
    )
    line, _ = live(events)  # full width: no longer shrunk, nothing queued
    assert line.status().endswith(", epoch 5, spares 0/0, last failure: n2 (process-exit) recovered in 0.50s")


def test_live_status_line_takes_the_spares_left_from_a_resize() -> None:
    line, _ = live(start() + [ev("job_resized", 114.16, how="shrink", node="n1", epoch=2, world_size=2, full=4)])
    assert "spares 2/2" in line.status()  # no spares_left: the count stays
    line, _ = live(
        start() + [ev("job_resized", 114.16, how="shrink", node="n1", epoch=2, world_size=2, full=4, spares_left=1)]
    )
    assert "spares 1/2" in line.status() and "shrunk to 2/4 ranks" in line.status()
    line, _ = live(
        start() + [ev("job_resized", 120.0, how="grow", node="n9", epoch=3, world_size=4, full=4, spares_left=0)]
    )
    assert "spares 0/2" in line.status() and "shrunk" not in line.status()
