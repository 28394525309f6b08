from __future__ import annotations

from pathlib import Path

from resild.controller.journal import Journal, replay


def test_records_survive_in_order_and_a_torn_tail_is_ignored(tmp_path: Path) -> None:
    p = tmp_path / "j" / "journal.jsonl"
    j = Journal(p)
    j.append({"action": "replace_node", "node": "a"})
    j.append({"action": "fail_job", "node": "b"})
    j.close()
    with open(p, "a") as f:
        f.write('{"action": "half')  # crash mid-write
    assert [r["node"] for r in replay(p)] == ["a", "b"]


def test_missing_journal_replays_nothing(tmp_path: Path) -> None:
    assert list(replay(tmp_path / "none.jsonl")) == []


def test_a_failing_disk_is_loud_surfaced_and_survived(tmp_path: Path, caplog) -> None:
    """A journal write failure (disk full) killed the controller; now the job goes on."""
    from resild.events.log import EventLog

    events = EventLog(None)
    j = Journal(tmp_path / "journal.jsonl", events=events)
    assert j.append({"action": "replace_node", "node": "a"}) and j.healthy

    class Full:
        def write(self, _: str) -> int:
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            raise OSError(28, "No space left on device")

        def fileno(self) -> int:
            return -1

        def close(self) -> None:
            raise OSError(28, "No space left on device")

    real, j._f = j._f, Full()
    assert j.append({"action": "fail_job", "node": "b"}) is False
    assert j.append({"action": "fail_job", "node": "c"}) is False
    assert not j.healthy and j.errors == 2 and "No space left" in (j.last_error or "")
    assert j.status()["healthy"] is False
    assert "JOURNAL WRITE FAILED" in caplog.text
    assert [e["event"] for e in events.records] == ["journal_error"]  # once per failure streak
    j._f = real
    assert j.append({"action": "replace_node", "node": "d"}) and j.healthy
    j.close()
    assert [r["node"] for r in replay(tmp_path / "journal.jsonl")] == ["a", "d"]


def test_unserialisable_record_does_not_raise(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.jsonl")
    assert j.append({"x": float("nan"), "y": object()}) is False and j.errors == 1
    j.close()
