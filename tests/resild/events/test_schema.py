"""The event schema: names unchanged on disk and on the wire, typed records that never raise."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from resild.daemon.agent import ProcState
from resild.events.log import EventLog, read_events
from resild.events.schema import (
    RECORDS,
    EventName,
    FailureDetected,
    JobStarted,
    MembershipEvent,
    Resumed,
    SpareAssigned,
    StateReplayed,
    event_time,
    parse,
)
from resild.wire.protocol import PEER_EVENTS, Event

REPO = Path(__file__).resolve().parents[3]

# The strings in files written before the schema existed: renaming one breaks every reader.
NAMES = """job_started node_registered worker_registered membership progress collective_failed
fault_injected failure_detected node_fenced spare_assigned job_resized reform full_strength_step rank_done
job_finished job_failed controller_restored controller_leader controller_stalled journal_error group_reformed
state_replayed resumed process_running process_exited process_zombie process_hung node_suspect
rolled_back snapshot_corrupt snapshots replica_diverged agreed_state state_unvouched checkpoint_loaded spare_warmed
gradients_differed steps_verified replica_arbitrated controller_error checkpoint_saved checkpoint_failed
checkpoint_deferred node_admitted join_refused node_readmitted spares_requested replica_layout spare_compiled
peer_refused node_abusive straggler stragglers_unwatched snapshot_cadence""".split()


def test_names_are_todays_strings() -> None:
    assert sorted(e.value for e in EventName) == sorted(NAMES)
    for e in EventName:
        assert e == e.value and e.name == e.value.upper()
        assert json.dumps(e) == json.dumps(e.value)  # the JSON is unchanged


def test_members_and_strings_are_interchangeable_as_keys() -> None:
    assert {EventName.RESUMED: 1}.get("resumed") == 1  # type: ignore[call-overload]
    assert {"resumed": 1}[EventName.RESUMED] == 1
    assert "resumed" in frozenset({EventName.RESUMED}) and EventName.RESUMED in {"resumed"}
    assert str(EventName.RESUMED) == "EventName.RESUMED"  # (str, Enum), not StrEnum


def test_emit_writes_the_same_line_and_a_plain_string(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    rec = log.emit(EventName.FAILURE_DETECTED, t_mono=1.0, node="n1", cause="x", detector="d", committed_step=4)
    log.emit("failure_detected", t_mono=1.0, node="n1", cause="x", detector="d", committed_step=4)
    log.close()
    assert type(rec["event"]) is str and f"{rec['event']}" == "failure_detected"
    a, b = (json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines())
    assert a["event"] == b["event"] == "failure_detected"


def test_round_trip_through_the_event_file(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    log.emit(EventName.JOB_STARTED, nodes=["a", "b"], endpoint="tcp://x")
    log.emit(EventName.FAILURE_DETECTED, node="b", cause="gone", detector="heartbeat", committed_step=7)
    log.emit(EventName.SPARE_ASSIGNED, spare="c", failed="b", epoch=2, ranks=[1], spares_left=0)
    log.emit(EventName.MEMBERSHIP, epoch=2, layout={"a": [0], "c": [1]}, view=2)
    log.emit(EventName.RESUMED, t_mono=9e3, node="a", rank=0, epoch=2, step=6, seconds=0.25)  # a worker's clock
    log.emit(EventName.STATE_REPLAYED, node="c", rank=1, epoch=2, bytes=10, seconds=0.1, step=6)
    log.close()
    recs = [parse(r) for r in read_events(tmp_path / "e.jsonl")]
    js, fd, sa, m, rs, st = recs
    assert isinstance(js, JobStarted) and js.nodes == ["a", "b"]
    assert isinstance(fd, FailureDetected) and (fd.node, fd.cause, fd.detector, fd.committed_step) == (
        "b",
        "gone",
        "heartbeat",
        7,
    )
    assert isinstance(sa, SpareAssigned) and (sa.spare, sa.failed, sa.epoch, sa.spares_left) == ("c", "b", 2, 0)
    assert not sa.before_start
    assert isinstance(m, MembershipEvent) and (m.epoch, m.nodes) == (2, ["a", "c"])
    assert isinstance(rs, Resumed) and (rs.epoch, rs.step, rs.seconds) == (2, 6, 0.25)
    assert rs.t != 9e3  # the log's clock (t_log), not the worker's
    assert isinstance(st, StateReplayed) and (st.bytes, st.seconds) == (10, 0.1)
    assert [r.t for r in recs if r is not None] == sorted(r.t for r in recs if r is not None)


@pytest.mark.parametrize(
    "rec",
    [
        None,
        3,
        "resumed",
        [],
        {},
        {"event": None, "t_mono": 1.0},
        {"event": 7, "t_mono": 1.0},
        {"event": "resumed"},  # no time
        {"event": "resumed", "t_mono": "later"},
        {"event": "resumed", "t_mono": float("nan")},
        {"event": "resumed", "t_mono": True},
        {"event": "some_event_from_the_future", "t_mono": 1.0},
        {"event": "worker.my_metric", "t_mono": 1.0, "value": 3},
        {"event": "rank_done", "t_mono": 1.0},  # known, but no analysis reads it
    ],
)
def test_what_is_not_a_usable_record_is_none(rec: Any) -> None:
    assert parse(rec) is None


def test_bad_field_types_become_none_or_neutral() -> None:
    r = parse({"event": "resumed", "t_mono": 1, "step": "12", "epoch": 2.0, "seconds": "slow", "extra": {"x": 1}})
    assert isinstance(r, Resumed) and (r.t, r.step, r.epoch, r.seconds) == (1.0, 12, 2, None)
    f = parse({"event": "failure_detected", "t_mono": 2.0, "t_log": "x", "node": 5, "committed_step": 1.5})
    assert isinstance(f, FailureDetected) and (f.t, f.node, f.cause, f.committed_step) == (2.0, "5", "", None)
    m = parse({"event": "membership", "t_mono": 1.0, "layout": ["not", "a", "dict"], "epoch": None})
    assert isinstance(m, MembershipEvent) and (m.nodes, m.epoch) == ([], None)
    s = parse({"event": "state_replayed", "t_mono": 1.0, "bytes": "many"})
    assert isinstance(s, StateReplayed) and s.bytes == 0
    assert event_time({"t_mono": 1.0, "t_log": 2.0}) == 2.0 and event_time({}) is None


def test_every_typed_record_reads_its_own_name_only() -> None:
    for name, cls in RECORDS.items():
        assert cls.NAME is name
        assert cls.from_record({"event": name.value, "t_mono": 1.0}) is not None  # every field optional
        other = next(n for n in EventName if n is not name)
        assert cls.from_record({"event": other.value, "t_mono": 1.0}) is None


def test_peer_events_are_schema_names_and_validate_from_plain_strings() -> None:
    assert all(isinstance(n, EventName) for n in PEER_EVENTS)
    for s in ProcState:  # the node daemon names its process events "process_<state>"
        assert EventName(f"process_{s.value}") in PEER_EVENTS
    ev = Event.from_dict({"node": "n", "name": "resumed", "fields": {"step": 3, "rank": 0}})
    assert isinstance(ev, Event) and ev.name == "resumed"  # not renamed worker.resumed


def test_no_bare_event_name_strings_at_emit_sites() -> None:
    bare = re.compile(r"""(?:\.emit|\b_event)\(\s*["']""")  # the name may be on the next line
    found = [
        f"{p.relative_to(REPO)}: {m.group(0)!r}"
        for root in ("resild", "launcher")
        for p in (REPO / root).rglob("*.py")
        for m in bare.finditer(p.read_text())
    ]
    assert found == []


def test_detector_names_are_made_only_by_the_schema() -> None:
    """Every detector the code names is a `Detector` member (or a health event's, built by
    `health_event_detector`): no free string `detector="..."` anywhere in resild/launcher."""
    import re
    from pathlib import Path

    from resild.events.schema import Detector, health_event_detector

    root = Path(__file__).resolve().parents[3]
    literal = re.compile(r"""detector["']?\s*[:=]=?\s*["'][a-z-]+["']""")
    found = [
        f"{p.relative_to(root)}: {m.group(0)}"
        for top in ("resild", "launcher")
        for p in (root / top).rglob("*.py")
        for m in literal.finditer(p.read_text())
    ]
    assert not found, found
    assert {d.value for d in Detector} >= {"process-exit", "heartbeat", "hang", "exception", "resild-agent"}
    assert health_event_detector("xid", kernel_log=True) == "kmsg-xid"
    assert health_event_detector("ecc_dbe", kernel_log=False) == "nvml-ecc_dbe"
