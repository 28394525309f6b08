"""A standby controller's leader ending the allocation when resil-run is gone with its
batch host (end_orphaned_job): pure, and with a real file touched by a thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resild.controller import replica
from resild.controller.replica import RUNNER_ALIVE, end_orphaned_job, runner_alive

pytestmark = pytest.mark.timeout(30)


def test_resil_run_is_alive_only_if_it_touched_the_file_since_the_leader_first_looked() -> None:
    assert runner_alive(5, 6) and runner_alive(None, 6)  # touched since (or created)
    assert not runner_alive(5, 5)  # recent or not: untouched since
    assert not runner_alive(5, None) and not runner_alive(None, None)  # no file


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    calls: list[tuple[str, str, str]] = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(replica.slurm, "release_job", lambda jid, why, mode: calls.append((jid, why, mode)) or "ok")
    return calls


def test_a_batch_host_lost_just_before_the_end_is_seen_gone(tmp_path: Path, released: list[Any]) -> None:
    (tmp_path / RUNNER_ALIVE).touch()  # resil-run's last touch, a moment before its host crashed
    end_orphaned_job(tmp_path, SimpleNamespace(exit_code=0, reason="finished"), stale_s=0.5)
    assert released == [("4242", "finished (batch host lost)", "cancel")]


def test_a_failed_job_whose_resil_run_is_gone_is_requeued(tmp_path: Path, released: list[Any]) -> None:
    end_orphaned_job(tmp_path, SimpleNamespace(exit_code=1, reason="no spare left"), stale_s=0.3)  # never touched
    assert released == [("4242", "no spare left (batch host lost)", "requeue")]


def test_a_resil_run_that_still_touches_the_file_ends_the_job_itself(tmp_path: Path, released: list[Any]) -> None:
    stop = threading.Event()

    def touch() -> None:
        while not stop.is_set():
            (tmp_path / RUNNER_ALIVE).touch()
            time.sleep(0.05)

    t = threading.Thread(target=touch)
    t.start()
    try:
        end_orphaned_job(tmp_path, SimpleNamespace(exit_code=0, reason="finished"), stale_s=5.0)
    finally:
        stop.set()
        t.join()
    assert released == []
