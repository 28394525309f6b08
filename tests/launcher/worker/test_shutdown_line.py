"""A worker stopped by the controller says so in one write: every rank stops at once, on
the stderr pipe it shares with resil-run's own last line (SystemExit's message is two
writes, and a CI run saw "...disk checkpointresil-run: job failed: ..." on one line)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from launcher.worker.runtime import Job

pytestmark = pytest.mark.timeout(30)


class Writes:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def stop(monkeypatch: pytest.MonkeyPatch, shutdown: dict[str, Any], waiting_spare: bool = False) -> tuple[int, Writes]:
    out = Writes()
    monkeypatch.setattr("sys.stderr", out)
    job: Any = SimpleNamespace(link=SimpleNamespace(shutdown=shutdown))
    with pytest.raises(SystemExit) as e:
        Job._check_shutdown(job, waiting_spare)
    assert isinstance(e.value.code, int)  # no message left for the interpreter to print in two writes
    return e.value.code, out


def test_a_failed_job_stops_each_rank_with_its_reason_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = stop(monkeypatch, {"exit_code": 1, "reason": "unrecoverable: no rank holds step 6"})
    assert code == 1
    assert out.calls == ["resild: job stopped by the controller: unrecoverable: no rank holds step 6\n"]


def test_a_finished_job_lets_a_waiting_spare_go_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = stop(monkeypatch, {"exit_code": 0}, waiting_spare=True)
    assert code == 0 and out.calls == []
