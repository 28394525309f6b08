from __future__ import annotations

from pathlib import Path

from resild.journal import Journal, replay


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
