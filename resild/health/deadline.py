"""Blocking calls with a deadline, for libraries that can hang in the kernel (NVML).

A call stuck in a driver cannot be cancelled from Python. DeadlineRunner runs
calls one at a time on a worker thread and, when one overruns, abandons that
worker (it exits once the call returns) and starts a fresh one for the next
call. Calls for a key (e.g. a GPU) whose earlier call is still stuck fail at
once instead of piling up threads on the same wedged device.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any


class CallTimeout(Exception):
    """A call did not return within its deadline (or an earlier one is still stuck)."""


class _Job:
    __slots__ = ("fn", "args", "name", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> None:
        self.fn, self.args, self.name = fn, args, name
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Worker:
    def __init__(self, thread_name: str) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.abandoned = False
        threading.Thread(target=self._run, name=thread_name, daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job.result = job.fn(*job.args)
            except BaseException as e:
                job.error = e
            job.done.set()
            if self.abandoned:
                return


class DeadlineRunner:
    """Serialises calls (one lock) and bounds each by a deadline."""

    def __init__(self, thread_name: str = "deadline-call") -> None:
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._stuck: dict[Hashable, tuple[_Job, float]] = {}  # key -> (job, since monotonic)
        self._longest_s = 0.0

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float, key: Hashable | None = None, name: str | None = None
    ) -> Any:
        """``fn(*args)``, or CallTimeout after ``timeout_s``; exceptions of fn propagate."""
        name = name or str(getattr(fn, "__name__", "call"))
        if key is not None and (stuck := self._stuck.get(key)) is not None:
            job, since = stuck
            if not job.done.is_set():
                raise CallTimeout(f"an earlier call ({job.name}) has not returned for {time.monotonic() - since:.1f} s")
            self._stuck.pop(key, None)
        self._longest_s = max(self._longest_s, timeout_s)
        # Every holder gives the lock up within its own deadline: the wait is bounded.
        if not self._lock.acquire(timeout=timeout_s + self._longest_s + 0.5):
            raise CallTimeout(f"{name}: lock busy")
        try:
            if self._worker is None:
                self._worker = _Worker(self._thread_name)
            job = _Job(fn, args, name)
            self._worker.jobs.put(job)
            if not job.done.wait(timeout_s):
                self._worker.abandoned = True
                self._worker.jobs.put(None)  # in case the call returns right now
                self._worker = None
                if key is not None:
                    self._stuck[key] = (job, time.monotonic())
                raise CallTimeout(f"{name} did not return within {timeout_s:g} s")
        finally:
            self._lock.release()
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Lets the idle worker thread exit (a stuck one exits when its call returns)."""
        with self._lock:
            if self._worker is not None:
                self._worker.jobs.put(None)
                self._worker = None
