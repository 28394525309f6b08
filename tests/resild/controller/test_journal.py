from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from resild.controller.journal import Journal
from resild.controller.policy import Action, Decision
from resild.controller.records import (
    Closed,
    DropSpare,
    FailJob,
    FaultFired,
    Leader,
    ReplaceNode,
    Start,
    Unknown,
    decided,
    parse_record,
)
from resild.controller.restore import Restored, fold
from resild.controller.view import JobResult
from resild.membership import Membership, NodeRole

M1 = Membership.initial(["a", "b"], 2)
M2 = M1.replace("b", "s0")


def lines(path: Path) -> list[dict[str, Any]]:
    """A journal file's records, the way a reader takes them: a torn line is skipped."""
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def start_state() -> Restored:
    roles = {"a": NodeRole.ACTIVE, "b": NodeRole.ACTIVE, "s0": NodeRole.SPARE, "s1": NodeRole.SPARE}
    return Restored(roles, dict.fromkeys(roles, ""), M1)


# Records exactly as the controller and replica.py wrote them before records were typed.
TODAY = [
    {"t_wall": 1.5, "action": "start", "reason": "every active worker registered", "membership": M1.to_dict()},
    {"t_wall": 2.0, "action": "fault_fired", "spec": "kill:b@10"},
    {
        "t_wall": 3.0,
        "action": "replace_node",
        "reason": "b failed",
        "node": "b",
        "spare": "s0",
        "membership": M2.to_dict(),
        "committed_step": 12,
    },
    {
        "t_wall": 4.0,
        "action": "drop_spare",
        "reason": "spare s1 failed",
        "node": "s1",
        "spare": None,
        "membership": None,
        "committed_step": 12,
    },
    {
        "t_wall": 4.5,
        "action": "reform",
        "reason": "collective failed",
        "node": None,
        "spare": None,
        "membership": M2.bump().to_dict(),
        "committed_step": 14,
    },
    {"action": "leader", "index": 1, "pid": 42, "t_wall": 5.0},
    {
        "t_wall": 6.0,
        "action": "finish",
        "reason": "all 4 ranks finished",
        "node": None,
        "spare": None,
        "membership": None,
        "committed_step": 20,
    },
    {"action": "closed", "index": 1, "t_wall": 7.0},
]


@pytest.mark.parametrize("raw", TODAY, ids=[r["action"] for r in TODAY])
def test_records_keep_todays_json_exactly(raw: dict[str, Any]) -> None:
    rec = parse_record(raw)
    assert not isinstance(rec, Unknown)
    assert json.dumps(rec.to_dict()) == json.dumps(raw)  # key order too
    assert parse_record(rec.to_dict()) == rec


def test_a_decision_is_journaled_as_before() -> None:
    d = Decision(Action.REPLACE_NODE, "b failed", node="b", spare="s0", membership=M2, detector="heartbeat")
    assert decided(d, 12, 3.0) == ReplaceNode("b failed", "b", "s0", M2, 12, 3.0)
    assert decided(d, 12, 3.0).to_dict() == TODAY[2]
    assert type(decided(Decision(Action.FAIL_JOB, "no spare", node="a"), 0, 0.0)) is FailJob


def test_an_unknown_action_is_kept_as_it_is_and_ignored() -> None:
    raw = {"action": "from_the_future", "x": [1, 2]}
    rec = parse_record(raw)
    assert rec == Unknown(raw) and rec.to_dict() == raw
    assert fold([rec], start_state()) == start_state()


def test_records_survive_in_order_and_a_torn_tail_is_ignored(tmp_path: Path) -> None:
    p = tmp_path / "j" / "journal.jsonl"
    j = Journal(p)
    j.append(Start(M1, t_wall=1.0))
    j.append(ReplaceNode("b failed", "b", "s0", M2, 7, 2.0))
    j.append(FailJob("no spare", "a", committed_step=9, t_wall=3.0))
    j.close()
    with open(p, "a") as f:
        f.write('{"action": "half')  # crash mid-write
    recs = [parse_record(r) for r in lines(p)]
    assert [type(r) for r in recs] == [Start, ReplaceNode, FailJob]
    s = fold(recs, start_state())
    assert s.membership == M2.with_committed(7)  # the epoch's floor: the committed step it was decided at
    assert s.max_step == 9 and s.result == JobResult(1, "no spare")
    assert s.roles == {"a": NodeRole.FENCED, "b": NodeRole.FENCED, "s0": NodeRole.ACTIVE, "s1": NodeRole.SPARE}
    assert s.reasons["b"] == "b failed" and s.reasons["a"] == "no spare"


def test_the_fold_over_todays_records() -> None:
    s = fold(map(parse_record, TODAY), start_state())
    assert s.membership == M2.bump().with_committed(14) and s.max_step == 20
    assert s.result == JobResult(0, "all 4 ranks finished")
    assert s.fired == frozenset({"kill:b@10"})
    assert s.roles == {"a": NodeRole.ACTIVE, "b": NodeRole.FENCED, "s0": NodeRole.ACTIVE, "s1": NodeRole.FENCED}
    assert s.initial == M1  # the job had started: epoch 1 as it was


def test_the_fold_keeps_start_up_replacements() -> None:
    s = fold([ReplaceNode("lost", "a", "s1")], start_state())
    assert s.membership is None and s.initial.epoch == 1 and set(s.initial.node_ranks) == {"s1", "b"}
    assert s.initial.node_ranks["s1"] == (0, 1)


def test_a_node_is_fenced_once_and_never_comes_back() -> None:
    s = fold([DropSpare("s1 failed", "s1"), ReplaceNode("a failed", "a", "s1", None, 3)], start_state())
    assert s.roles["s1"] == NodeRole.FENCED and s.roles["a"] == NodeRole.FENCED  # a fenced spare is not activated
    assert s.reasons["s1"] == "s1 failed" and s.max_step == 3


def test_replica_records() -> None:
    assert parse_record(Leader(1, 42, 5.0).to_dict()) == Leader(1, 42, 5.0)
    assert parse_record(Closed(2, 7.0).to_dict()) == Closed(2, 7.0)
    assert parse_record(FaultFired("kill:b@10", 2.0).to_dict()) == FaultFired("kill:b@10", 2.0)


def test_a_failing_disk_is_loud_surfaced_and_survived(tmp_path: Path, caplog) -> None:
    """A journal write failure (disk full) killed the controller; now the job goes on."""
    from resild.events.log import EventLog

    events = EventLog(None)
    j = Journal(tmp_path / "journal.jsonl", events=events)
    assert j.append(DropSpare("r", "a")) and j.healthy

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
    assert j.append(FailJob("r", "b")) is False
    assert j.append(FailJob("r", "c")) is False
    assert not j.healthy and j.errors == 2 and "No space left" in (j.last_error or "")
    assert j.status()["healthy"] is False
    assert "JOURNAL WRITE FAILED" in caplog.text
    assert [e["event"] for e in events.records] == ["journal_error"]  # once per failure streak
    j._f = real
    assert j.append(DropSpare("r", "d")) and j.healthy
    j.close()
    assert [r["node"] for r in lines(tmp_path / "journal.jsonl")] == ["a", "d"]


def test_unserialisable_record_does_not_raise(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j.jsonl")
    assert j.write({"x": float("nan"), "y": object()}) is False and j.errors == 1
    j.close()
