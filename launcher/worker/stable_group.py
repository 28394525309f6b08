"""A process group that outlives communicator failures.

User code and torch's wrappers (DDP, FSDP2, DeviceMesh) hold one `StableGroup`
for the whole job. Underneath, resild swaps the backend group (gloo or NCCL,
one code path) at every membership epoch. Survivors keep their ranks (a hot
spare takes the failed node's ranks), so rank and size never change.

Collectives never raise into user code and never block past a new epoch: a
failed or interrupted collective completes with whatever is in its buffers and
*latches* an error (`Interrupts`); the commit then abandons the step and runs
recovery. torchft's `ProcessGroupWrapper` and its errored-latch are the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from launcher.worker.torch_private import (
    GroupName,
    PrefixStore,
    PyProcessGroup,
    PyWork,
    backend_group,
    register_group,
)


class Interrupts:
    """Shared by the training thread, the control thread and backend threads:
    the latched error of the current epoch and the collectives in flight."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: str | None = None
        self.gen = 0  # bumped per epoch: a late failure of an old epoch's work must not latch the new one
        self._works: dict[int, tuple[float, ManagedWork | None]] = {}  # None: a wait that is not a collective
        self._next = 0

    def fail(self, reason: str, gen: int | None = None) -> None:
        """Latch `reason` and release every waiter (their buffers are garbage now)."""
        with self.cond:
            if gen is not None and gen != self.gen:
                return
            if self.error is None:
                self.error = reason
            works = [w for _, w in self._works.values() if w is not None]
            self._works.clear()
            self.cond.notify_all()
        for w in works:
            w._complete()

    def clear(self) -> None:
        with self.cond:
            self.error = None
            self.gen += 1

    def _add(self, w: ManagedWork | None) -> int:
        with self.cond:
            self._next += 1
            self._works[self._next] = (time.monotonic(), w)
            return self._next

    def _done(self, key: int) -> None:
        with self.cond:
            self._works.pop(key, None)
            self.cond.notify_all()

    def begin_wait(self) -> int:
        """Count a blocking wait that is not a collective (group formation) as in flight,
        so the rank reports itself waiting rather than being blamed for a hang."""
        return self._add(None)

    def oldest_in_flight_s(self, now: float) -> float:
        """How long the oldest collective in flight has been waiting (0 if none)."""
        with self.cond:
            return max((now - t0 for t0, _ in self._works.values()), default=0.0)

    def wait_until(self, pred: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block until `pred()` or a latched error; True if pred() holds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            while not pred():
                if self.error is not None:
                    return False
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    return pred()
                self.cond.wait(left)
            return True


class ManagedWork(PyWork):
    """Wraps a backend Work: done when the backend is, or at once when the epoch is
    interrupted. Completion with an error latches it; nothing raises.

    Cheap on the hot path (FSDP2 issues a dozen collectives a step): a wait polls the
    backend work's future with a short, growing nap; our own torch Future (DDP's
    reducer waits on one in C++) is made only when asked for. Works without a future
    (gloo's point-to-point and reduce_scatter_single never report completion before
    wait() is called) are waited on in a helper thread."""

    def __init__(self, inner: Any, result: Any, intr: Interrupts, p2p: bool = False) -> None:
        super().__init__()
        self._inner, self._result, self._intr = inner, result, intr
        self._gen = intr.gen
        self._lock = threading.Lock()
        self._done = False
        self._fut: torch.futures.Future[Any] | None = None
        self._key: int | None = None
        self._threaded = False
        self._inner_fut: torch.futures.Future[Any] | None = None
        if not p2p:
            try:
                self._inner_fut = inner.get_future()
            except RuntimeError:
                p2p = True  # e.g. gloo's reduce_scatter_single: no future, and no completion before wait()
        if p2p:
            self._track()
            self._start_thread()

    def _track(self) -> None:
        """Count as in flight: reported as waiting, and released by Interrupts.fail()."""
        with self._lock:
            if not self._done and self._key is None:
                self._key = self._intr._add(self)

    def _start_thread(self) -> None:
        self._threaded = True
        threading.Thread(target=self._settle, name="resild-work", daemon=True).start()

    def _settle(self) -> None:
        try:
            self._inner.wait()
        except Exception as e:  # gloo: peer reset; NCCL: communicator aborted
            self._intr.fail(f"collective failed: {e}", self._gen)
        self._complete()

    def _on_future(self, f: torch.futures.Future[Any]) -> None:
        try:
            f.wait()
        except Exception as e:
            self._intr.fail(f"collective failed: {e}", self._gen)
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            key, fut = self._key, self._fut
            self._key = None
        if key is not None:
            self._intr._done(key)
        if fut is not None and not fut.done():
            fut.set_result(self._result)

    def _backend_done(self) -> bool:
        return not self._threaded and self._inner_fut is not None and self._inner_fut.done()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        if self._backend_done():
            self._settle()
            return True
        self._track()
        nap_s = 2e-5
        cond = self._intr.cond
        while not self._done:
            if self._intr.error is not None:
                self._complete()
                break
            if self._backend_done():
                self._settle()
                break
            with cond:
                cond.wait(nap_s)
            nap_s = min(nap_s * 2, 1e-3)
        return True

    def is_completed(self) -> bool:
        return self._done or self._intr.error is not None or self._backend_done()

    def is_success(self) -> bool:
        return self._intr.error is None

    def get_future(self) -> torch.futures.Future[Any]:
        with self._lock:
            if self._fut is not None:
                return self._fut
            fut = self._fut = torch.futures.Future()
            done = self._done
        if done:
            fut.set_result(self._result)
            return fut
        self._track()
        if not self._threaded and self._inner_fut is not None:
            self._inner_fut.add_done_callback(self._on_future)
        return fut


class _DoneWork(PyWork):
    """Returned once the epoch has latched an error: the step is lost anyway."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._fut: torch.futures.Future[Any] = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut


class NotJoined(RuntimeError):
    pass


class StableGroup(PyProcessGroup):
    """One rank's view of a group whose backend is replaced at every epoch."""

    def __init__(self, name: str, ranks: list[int], rank: int, intr: Interrupts) -> None:
        super().__init__(ranks.index(rank), len(ranks))
        self.label, self.ranks, self.global_rank = name, list(ranks), rank
        self._intr = intr
        self._inner: Any = None  # the epoch's backend ProcessGroup
        self.allow = False  # collectives allowed (joined and attached)
        self.backend: str | None = None  # None: the job's backend; "gloo" for host-memory traffic on a GPU job

    # torch reads these
    @property
    def group_name(self) -> GroupName:
        return GroupName(self.label)

    def getBackendName(self) -> str:
        return "resild"

    def set_backend(self, inner: Any) -> None:
        self._inner = inner

    def _run(self, result: Any, op: Callable[[Any], Any], p2p: bool = False) -> dist.Work:
        """Issue one collective on this epoch's backend (`op(backend)`), managed."""
        if not self.allow:
            raise NotJoined(
                f"resild: a collective on group {self.label!r} before job.attach(): under resild a spare joins a "
                "running job, so nothing may communicate before attach (construct DDP with init_sync=False; "
                "resild makes replicas equal at attach)"
            )
        if self._intr.error is not None or self._inner is None:
            return _DoneWork(result)
        try:
            work = op(self._inner)
        except Exception as e:  # e.g. gloo refusing to start on a dead connection
            self._intr.fail(f"collective failed to start: {e}")
            return _DoneWork(result)
        return ManagedWork(work, result, self._intr, p2p)


def register(pg: StableGroup, store: Any) -> None:
    """Make a subgroup known to c10d the way `new_group` would (ranks, name, the
    functional-collective registry), without new_group's job-wide barrier."""
    register_group(pg, pg.label, pg.ranks, store)


def install_default(pg: StableGroup, store: Any) -> None:
    """Make the world StableGroup torch's default group, so `dist.get_rank()`,
    DDP without `process_group=` and DeviceMesh all see it."""
    if dist.is_initialized():
        raise RuntimeError("resild: torch.distributed is already initialised; let launcher.init() set it up")
    dist.Backend.register_backend("resild", lambda *a, **k: pg, devices=["cpu", "cuda"])
    dist.init_process_group(
        "resild", store=PrefixStore("resild/user/", store), rank=pg.global_rank, world_size=pg.size()
    )


class GroupFactory:
    """Builds one epoch's backend group for a StableGroup: gloo on CPU, NCCL on
    GPU, wrapped in a c10d ProcessGroup so every collective name resolves."""

    def __init__(
        self, backend: str, store_client: Callable[[], Any], timeout_s: float, gloo_host: str | None = None
    ) -> None:
        self.backend, self._store_client, self.timeout_s, self.gloo_host = backend, store_client, timeout_s, gloo_host

    def build(self, epoch: int, group: StableGroup) -> Any:
        """Blocking (gloo connects a full mesh here); run it off the training thread.
        Each formation gets its own store client: an abandoned one blocks in
        store.wait() holding its client, which would stall the next epoch."""
        store = PrefixStore(f"resild/e{epoch}/{group.label}/", self._store_client())
        timeout = timedelta(seconds=self.timeout_s)
        backend = group.backend or self.backend
        return backend_group(backend, store, group.rank(), group.size(), timeout, self.gloo_host)


def abort(inner: Any) -> None:
    """NCCL: interrupts pending kernels (ncclCommAbort); gloo: returns at once
    without interrupting a pending recv, which is why waits watch the epoch."""
    try:
        inner.abort()
    except Exception:
        pass
