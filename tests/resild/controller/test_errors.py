"""The controller's own errors: reported once per place per interval (errors.py), the
decision to give up (policy.give_up_verdict), and their journal record (ignored by restore)."""

from __future__ import annotations

from pathlib import Path

from resild.controller.errors import InternalErrors
from resild.controller.journal import Journal
from resild.controller.policy import give_up_verdict
from resild.controller.records import ControllerError, parse_record
from resild.controller.restore import Restored, apply
from resild.events.log import EventLog
from resild.membership import Membership, NodeRole


def test_give_up_only_after_every_round_failed_for_the_limit() -> None:
    assert not give_up_verdict(100.0, None, 60.0).guilty  # the last round went through
    assert not give_up_verdict(159.9, 100.0, 60.0).guilty
    v = give_up_verdict(160.0, 100.0, 60.0)
    assert v.guilty and "60.0s" in v.reason
    assert not give_up_verdict(1e9, 100.0, 0.0).guilty  # 0: never


def test_errors_are_reported_once_per_place_per_interval_with_the_count(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    journal = Journal(tmp_path / "journal.jsonl")
    errors = InternalErrors(events, journal, report_s=10.0)
    try:
        for i in range(50):  # every tick for a second
            errors.record("tick:checks", ValueError(f"bug {i}"), 100.0 + i * 0.02)
        errors.record("handler:event", KeyError("x"), 101.0, sender="a/node")
        errors.record("tick:checks", ValueError("bug again"), 110.5)
        errors.record("tick", RuntimeError("gave up"), 110.6, fatal=True)  # always said
        recs = [e for e in events.records if e["event"] == "controller_error"]
        assert [(e["where"], e["count"], e["fatal"]) for e in recs] == [
            ("tick:checks", 1, False),
            ("handler:event", 1, False),
            ("tick:checks", 50, False),  # the 49 in between, counted
            ("tick", 1, True),
        ]
        assert recs[1]["sender"] == "a/node" and "ValueError" in recs[0]["traceback"]
        assert errors.total == 53
    finally:
        journal.close()
        events.close()
    lines = (tmp_path / "journal.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_the_journal_record_round_trips_and_changes_nothing_on_restore() -> None:
    rec = ControllerError("tick:checks", "ValueError('x')", 3, False, 12.5)
    assert parse_record(rec.to_dict()) == rec
    m = Membership.initial(["a"], 1)
    before = Restored({"a": NodeRole.ACTIVE}, {"a": ""}, m, m, 7, None)
    assert apply(before, rec) == before
    assert apply(before, rec).result is None  # no verdict from an error
