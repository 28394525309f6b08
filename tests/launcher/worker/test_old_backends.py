"""The failed epoch's backends: aborted in the background, each once, kept alive until
buried, and fenced only where a late writer can exist. Fake backends whose abort blocks
on an event: no timing."""

from __future__ import annotations

import threading
import time

import pytest

from launcher.worker.old_backends import AbortStuck, OldBackends, injected_delay

pytestmark = pytest.mark.timeout(30)


class Slow:
    """A backend whose abort returns when the test says so."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1
        self.started.set()
        assert self.release.wait(20)


def _abort(b: Slow) -> None:
    b.abort()


def _until(cond, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return bool(cond())


def test_abort_returns_at_once_and_the_fence_waits_for_the_abort() -> None:
    old, b = OldBackends(_abort, bury_s=0.0), Slow()
    old.abort([b], fenced=True)  # returns while the abort is blocked
    assert b.started.wait(5) and old.pending() == 1 and old.held() == 1
    fenced = threading.Event()
    t = threading.Thread(target=lambda: (old.fence(20), fenced.set()))
    t.start()
    assert not fenced.wait(0.2)  # still aborting: nothing may run on the new backends yet
    b.release.set()
    assert fenced.wait(10)
    t.join()
    assert old.pending() == 0
    assert _until(lambda: old.held() == 0)  # buried once aborted (bury_s 0)


def test_each_backend_is_aborted_once_when_the_failure_and_the_retirement_both_abort_it() -> None:
    old, b, c = OldBackends(_abort, bury_s=0.0), Slow(), Slow()
    b.release.set()
    c.release.set()
    old.abort([b], fenced=True)  # at the failure (NCCL)
    old.abort([b, c], fenced=True)  # when the epoch retires
    old.fence(10)
    assert (b.aborts, c.aborts) == (1, 1)
    assert _until(lambda: old.held() == 0)  # buried (bury_s 0): still remembered while they live
    old.abort([b, c], fenced=True)  # a late retirement after a long wait for the notice
    old.fence(10)
    assert (b.aborts, c.aborts) == (1, 1)


def test_an_unfenced_abort_is_never_awaited_and_is_kept_alive_until_it_returns() -> None:
    old, b = OldBackends(_abort, bury_s=0.0), Slow()
    old.abort([b], fenced=False)  # gloo: no late writer
    assert b.started.wait(5)
    assert old.fence(10) < 1.0 and old.pending() == 1 and old.held() == 1
    b.release.set()
    assert _until(lambda: old.held() == 0)


def test_an_abort_that_never_returns_stops_the_rank_at_the_fence() -> None:
    old, b = OldBackends(_abort, bury_s=0.0), Slow()
    old.abort([b], fenced=True)
    with pytest.raises(AbortStuck, match="did not abort"):
        old.fence(0.1)
    b.release.set()


def test_a_failing_abort_still_counts_as_returned() -> None:
    def boom(_: object) -> None:
        raise RuntimeError("abort failed")

    old = OldBackends(boom, bury_s=0.0)
    old.abort([object()], fenced=True)
    old.fence(10)  # no hang: the batch is done whatever abort raised
    assert old.pending() == 0


def test_the_injected_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILD_ABORT_DELAY_S", "1.5")
    assert injected_delay() == (1.5, False)
    monkeypatch.setenv("RESILD_ABORT_DELAY_S", "2:fenced")
    assert injected_delay() == (2.0, True)
    for bad in ("x", "-3", "", "nan", "1:sometimes"):
        monkeypatch.setenv("RESILD_ABORT_DELAY_S", bad)
        assert injected_delay() == (0.0, False)
