"""EventTail: following an event file that is still being written."""

from __future__ import annotations

import json
from pathlib import Path

from resild.events.log import EventTail


def line(n: int) -> bytes:
    return (json.dumps({"event": "progress", "step": n}) + "\n").encode()


def test_tail_reads_complete_lines_once(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    t = EventTail(p)
    assert t.poll() == []  # no file yet
    p.write_bytes(line(1) + line(2)[:7])  # the writer is mid-line
    assert [e["step"] for e in t.poll()] == [1]
    with open(p, "ab") as f:
        f.write(line(2)[7:] + b"not json\n" + line(3))
    assert [e["step"] for e in t.poll()] == [2, 3]  # the torn line joined, the bad one skipped
    assert t.poll() == []


def test_tail_from_end_skips_older_jobs_and_restarts_after_truncation(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(line(1) + line(2))
    t = EventTail(p, from_end=True)
    assert t.poll() == []
    with open(p, "ab") as f:
        f.write(line(3))
    assert [e["step"] for e in t.poll()] == [3]
    p.write_bytes(line(9))  # replaced by a shorter file
    assert [e["step"] for e in t.poll()] == [9]


def test_tail_waits_for_data_not_yet_visible_and_follows_a_replaced_file(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    t = EventTail(p)
    p.write_bytes(line(1) + b"\0" * 20 + b"\n" + line(3))  # a shared filesystem's hole
    assert [e["step"] for e in t.poll()] == [1]
    p.write_bytes(line(1) + line(2)[:-1].ljust(20) + b"\n" + line(3))  # the data arrived
    assert [e["step"] for e in t.poll()] == [2, 3]
    new = tmp_path / "new.jsonl"
    new.write_bytes(line(7) + line(8) + line(9) + line(10))
    new.replace(p)  # a new, longer file in its place
    assert [e["step"] for e in t.poll()] == [7, 8, 9, 10]
