"""A failed epoch's backends, aborted off the recovery's critical path.

Aborting an NCCL communicator takes about a second (measured on an H200), more than the
rest of a CPU recovery; gloo's abort returns at once. The recovery does not wait for it:
`abort` hands backends to a thread of their own (at the failure, for NCCL, and for every
backend when the epoch retires), and the new epoch's backends form meanwhile. Until its
abort has returned, an old backend is kept alive and away from the new one (freeing a
gloo group whose threads are blocked on a dead peer can deadlock; an NCCL communicator's
memory must not be reused under a kernel that may still run).

The fence: a kernel of an old NCCL communicator blocked on a dead peer can still write
into its collective's output (a gradient bucket, an all-gather buffer) until its abort
has returned. `fence()` waits for every abort that can stop such a writer, and the
recovery calls it once the new backends have formed and before any collective on them:
the agreement, the replay into the live state and the next step all come after the old
communicator's last write. gloo has no such writer (an old op runs on gloo's own threads
and writes only the bytes its old peers sent before they stopped), so its aborts are never
awaited: a gloo recovery does not wait for them at all. On NCCL the gain is smaller today:
the new communicator connects lazily, in its first collective, which comes after the
fence, so only the rest of forming (the groups' rendezvous) overlaps the abort; connecting
it eagerly in the forming thread would overlap the two (not done: to measure on a GPU).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from resild.wire import env as resild_env

log = logging.getLogger(__name__)
DELAY_ENV = resild_env.ABORT_DELAY_S.name


def injected_delay() -> tuple[float, bool]:
    """Tests and drills (RESILD_ABORT_DELAY_S): seconds added to every abort, as NCCL's
    takes, and with `:fenced` whether gloo's are fenced as NCCL's are (what a GPU
    recovery waits for, simulated): `3`, `3:fenced`. Unreadable: (0, False)."""
    raw = os.environ.get(DELAY_ENV) or ""
    value, _, mode = raw.partition(":")
    try:
        delay_s = float(value or 0.0)
    except ValueError:
        return 0.0, False
    if not delay_s >= 0 or mode not in ("", "fenced"):  # NaN too
        return 0.0, False
    return delay_s, mode == "fenced"


class AbortStuck(RuntimeError):
    """An old communicator's abort has not returned: its kernels may still write."""


@dataclass
class _Batch:
    backends: list[Any]
    fenced: bool  # its abort stops a writer that could otherwise touch the new epoch's state
    done: threading.Event = field(default_factory=threading.Event)


class OldBackends:
    """Backends being aborted, each once, and kept alive until `bury_s` after their abort."""

    def __init__(self, abort: Callable[[Any], None], bury_s: float, delay_s: float = 0.0) -> None:
        self._abort, self.bury_s, self.delay_s = abort, bury_s, delay_s
        self._lock = threading.Lock()
        self._batches: list[_Batch] = []  # not yet buried: holds the strong references
        self._seen: weakref.WeakSet[Any] = weakref.WeakSet()  # ever handed to abort, for as long as they live

    def _new(self, b: Any, held: set[int]) -> bool:
        if id(b) in held:
            return False
        try:
            if b in self._seen:
                return False
            self._seen.add(b)
        except TypeError:  # not weakly referenceable: known only while held
            pass
        return True

    def abort(self, backends: Sequence[Any], fenced: bool) -> None:
        """Start aborting those of `backends` never handed here before; returns at once.
        (The failure's abort and the retirement's name the same NCCL communicators.)"""
        with self._lock:
            held = {id(b) for batch in self._batches for b in batch.backends}
            batch = _Batch([b for b in backends if self._new(b, held)], fenced)
            if not batch.backends:
                return
            self._batches.append(batch)
        threading.Thread(target=self._run, args=(batch,), name="resild-abort", daemon=True).start()

    def _run(self, batch: _Batch) -> None:
        try:
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            for b in batch.backends:
                try:
                    self._abort(b)
                except Exception as e:  # aborted or not, it is given up on: nothing else to do
                    log.warning("aborting a failed epoch's backend: %r", e)
        finally:
            batch.done.set()
        time.sleep(self.bury_s)
        with self._lock:
            self._batches.remove(batch)

    def pending(self) -> int:
        """Backends whose abort has not returned yet."""
        with self._lock:
            return sum(len(b.backends) for b in self._batches if not b.done.is_set())

    def held(self) -> int:
        """Backends still kept alive (aborting, or aborted and not yet buried)."""
        with self._lock:
            return sum(len(b.backends) for b in self._batches)

    def fence(self, timeout_s: float) -> float:
        """Wait until every fenced abort has returned; the seconds waited. AbortStuck if one
        has not returned within `timeout_s`: its kernels may still write, so the rank
        cannot go on safely (it fails, and its node is replaced)."""
        t0 = time.monotonic()
        with self._lock:
            waiting = [b for b in self._batches if b.fenced]
        for b in waiting:
            left = timeout_s - (time.monotonic() - t0)
            if not b.done.wait(max(0.0, left)):
                raise AbortStuck(
                    f"the failed epoch's communicator did not abort within {timeout_s:.0f}s: "
                    "its kernels may still write into this rank's state"
                )
        return time.monotonic() - t0
