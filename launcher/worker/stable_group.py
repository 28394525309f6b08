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

import enum
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from launcher.worker.torch_private import (
    GroupName,
    PrefixStore,
    PyProcessGroup,
    PyWork,
    allgather_into,
    backend_group,
    gloo_reduce_scatter,
    register_group,
)


class WaitMode(enum.Enum):
    """How a rank waits on one backend work without ever blocking past a new epoch.

    STREAM (NCCL): `wait()` only makes the current CUDA stream wait for the collective;
        the CPU never blocks on the GPU (overlap is kept). A hung NCCL kernel is released
        by the communicator's abort, which the control thread issues when the epoch is
        interrupted (`Interrupts.on_fail`).
    SLICED (gloo collectives): the backend's own condition-variable wait, in slices of
        10-20 ms; between slices the latched error is checked. A collective that completes
        costs one backend wait: no thread hand-off, no polling.
    THREAD (gloo send/recv and the list reduce-scatter): a timed-out wait on send/recv
        breaks gloo's pair, and gloo's reduce-scatter Works ignore the timeout (torch 2.13:
        their wait blocks until the peer answers or its connection closes, seen as survivors
        stuck seconds behind a dead peer; a one-tensor reduce-scatter is therefore issued as
        its all-reduce, `gloo_reduce_scatter`, and is SLICED). These are waited on to the
        end in a pooled helper thread, and the rank waits on the helper or the epoch.
    """

    STREAM = "stream"
    SLICED = "sliced"
    THREAD = "thread"


def wait_mode(backend_kind: str | None, untimed: bool) -> WaitMode:
    """`untimed`: the op's gloo Work must not be waited on with a timeout (THREAD)."""
    if backend_kind == "nccl":
        return WaitMode.STREAM
    return WaitMode.THREAD if untimed else WaitMode.SLICED


# A timed-out backend wait raises a c10::Error (~0.2 ms: it captures a C++ backtrace), so
# slices are long enough that a collective which completes rarely pays one, and short
# enough that a hung wait notices a new epoch within 20 ms.
_FIRST_SLICE_S, _MAX_SLICE_S = 1e-2, 2e-2
_TIMED_OUT = "Operation timed out!"  # c10d Work::wait(timeout) when the timeout passes; nothing else is touched


class _Waiters:
    """Daemon threads that wait on gloo send/recv works to the end, reused when idle. Not
    concurrent.futures: its threads are joined at interpreter exit, and a wait stuck on a
    dead peer would hold the process until gloo's timeout."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._run, name="resild-work", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._jobs.get()()
            with self._lock:
                self._idle += 1


_waiters = _Waiters()


class Interrupts:
    """Shared by the training thread, the control thread and backend threads:
    the latched error of the current epoch and the collectives in flight."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.error: str | None = None
        self.gen = 0  # bumped per epoch: a late failure of an old epoch's work must not latch the new one
        self._works: dict[int, tuple[float, ManagedWork | None]] = {}  # None: a wait that is not a collective
        self._next = 0
        # NCCL works never block a CPU wait; they are in flight until their GPU work is done.
        self._stream: deque[tuple[float, Any]] = deque()
        self.on_fail: list[Callable[[], None]] = []  # run once per latched error; must not block
        self._pinned = threading.local()

    def pin(self, gen: int | None) -> None:
        """Bind the calling thread to epoch generation `gen` (None: unbind). A pinned thread's
        collectives on groups of these Interrupts are issued only while `gen` is current,
        and raise `StaleEpoch` after: a background thread of a failed epoch (a disk
        checkpoint still writing across a recovery) must never pair its collectives with the
        new epoch's, which once fed a peer's unpickling an empty buffer and left the other
        ranks waiting (issue 41). It raises rather than returning garbage: DCP sizes its
        next buffer from what a collective returned. Only resild's own threads are pinned,
        so nothing raises into user code."""
        self._pinned.gen = gen

    def stale(self) -> bool:
        """Is the calling thread pinned to an epoch that has failed or passed? Read under the
        lock: `clear()` ends an epoch's error and bumps its generation in one step, and a
        read between the two would let a stale thread onto the new epoch's backend."""
        gen = getattr(self._pinned, "gen", None)
        if gen is None:
            return False
        with self.cond:
            return self.error is not None or gen != self.gen

    def fail(self, reason: str, gen: int | None = None) -> None:
        """Latch `reason` and release every waiter (their buffers are garbage now)."""
        with self.cond:
            if gen is not None and gen != self.gen:
                return
            first = self.error is None
            if first:
                self.error = reason
            works = [w for _, w in self._works.values() if w is not None]
            # A wait that is not a collective (group formation, recovery) stays counted
            # until its owner ends it: it may still block, and must not be blamed for a hang.
            self._works = {k: v for k, v in self._works.items() if v[1] is None}
            self._stream.clear()
            self.cond.notify_all()
        for w in works:
            w._complete()
        if first:
            for hook in list(self.on_fail):
                hook()

    def clear(self) -> None:
        with self.cond:
            self.error = None
            self.gen += 1
            self._stream.clear()

    def _add(self, w: ManagedWork | None, t0: float | None = None) -> int | None:
        """Count `w` in flight; None (not counted) for a collective whose epoch has already
        failed or passed: `fail()` has released the works it knew, and nothing would release
        this one (DDP's reducer asks for a work's future after `allreduce` returns, and the
        epoch can fail in between: its backward then waited out gloo's timeout)."""
        with self.cond:
            if w is not None and (self.error is not None or w._gen != self.gen):
                return None
            self._next += 1
            self._works[self._next] = (time.monotonic() if t0 is None else t0, w)
            return self._next

    def done(self, key: int) -> None:
        """The wait `key` (from begin_wait, or a work's) ended."""
        with self.cond:
            self._works.pop(key, None)
            self.cond.notify_all()

    def add_stream(self, inner: Any) -> None:
        """An NCCL work: counted in flight until `is_completed()` (its GPU event) says done."""
        self._stream.append((time.monotonic(), inner))
        if len(self._stream) > 256:  # pruned here too, so a job nobody asks about stays bounded
            self._prune_stream()

    def _prune_stream(self) -> None:
        s = self._stream
        try:
            while s and s[0][1].is_completed():
                s.popleft()
        except (RuntimeError, IndexError):  # an aborted communicator's work; or cleared meanwhile
            s.clear()

    def begin_wait(self) -> int:
        """Count a blocking wait that is not a collective (group formation) as in flight,
        so the rank reports itself waiting rather than being blamed for a hang."""
        key = self._add(None)
        assert key is not None  # a non-collective wait is always counted
        return key

    def oldest_in_flight_s(self, now: float) -> float:
        """How long the oldest collective in flight has been waiting (0 if none)."""
        self._prune_stream()
        with self.cond:
            oldest = min((t0 for t0, _ in self._works.values()), default=now)
        s = self._stream
        if s:
            try:
                oldest = min(oldest, s[0][0])
            except IndexError:
                pass
        return max(0.0, now - oldest)

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


class StaleEpoch(RuntimeError):
    """A collective from a thread pinned to an epoch that has passed (Interrupts.pin)."""


class ManagedWork(PyWork):
    """Wraps a backend Work: done when the backend is, or at once when the epoch is
    interrupted. Completion with an error latches it; nothing raises.

    The hot path (FSDP2 issues a dozen collectives a step) is one backend wait (see
    `WaitMode`); a wait that outlasts its first slice counts as in flight (for the hang
    detector) from when it began until the collective ends. Our own torch Future (DDP's reducer waits on one
    in C++) is made only when asked for."""

    def __init__(
        self,
        inner: Any,
        result: Any,
        intr: Interrupts,
        mode: WaitMode = WaitMode.SLICED,
        post: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._inner, self._result, self._intr, self._mode = inner, result, intr, mode
        self._post = post  # run once the backend work has succeeded, before anyone sees it done
        self._has_post = post is not None
        self._gen = intr.gen
        self._lock = threading.Lock()
        self._done = False
        self.succeeded = False  # the backend work itself completed without error
        self._fut: torch.futures.Future[Any] | None = None
        self._key: int | None = None
        self._settling = False
        if mode is WaitMode.STREAM:
            intr.add_stream(inner)
        elif mode is WaitMode.THREAD:
            self._track()
            self._settle_in_pool()

    def _track(self, t0: float | None = None) -> None:
        """Count as in flight: reported as waiting, and released by Interrupts.fail(); done
        at once if its epoch has already failed (fail() cannot release it any more)."""
        with self._lock:
            if self._done or self._key is not None:
                return
            self._key = self._intr._add(self, t0)
            released = self._key is None
        if released:
            self._complete()

    def _settle_in_pool(self) -> None:
        with self._lock:
            if self._settling or self._done:
                return
            self._settling = True
        _waiters.submit(self._settle)

    def _settle(self) -> None:
        """Wait on the backend to the end (a helper thread, or NCCL's non-blocking wait)."""
        try:
            self._inner.wait()
        except Exception as e:  # gloo: peer reset; NCCL: communicator aborted
            self._intr.fail(f"collective failed: {e}", self._gen)
            self._complete()
        else:
            self._complete(ok=True)

    def _on_future(self, f: torch.futures.Future[Any]) -> None:
        try:
            f.wait()
        except Exception as e:
            self._intr.fail(f"collective failed: {e}", self._gen)
            self._complete()
        else:
            self._complete(ok=True)

    def _complete(self, ok: bool = False) -> None:
        """Done. `ok`: the backend work succeeded, so the post step (if any) runs first,
        once, unless the epoch has failed meanwhile (the buffers are garbage then)."""
        err: Exception | None = None
        if ok:
            self.succeeded = True
        if self._post is not None:
            # Under the lock to its end: a second completer (a future's callback beside a
            # wait) must not report the work done while the copy is still running.
            with self._lock:
                post, self._post = self._post, None  # dropped either way: it holds a buffer
                if ok and post is not None and self._intr.error is None and self._gen == self._intr.gen:
                    try:
                        post()
                    except Exception as e:  # never into user code, never a work left undone
                        err = e
        if err is not None:  # outside the lock: fail() completes the works it tracks, this one too
            self._intr.fail(f"collective failed: {err}", self._gen)
        with self._lock:
            if self._done:
                return
            self._done = True
            key, fut = self._key, self._fut
            self._key = None
        if key is not None:
            self._intr.done(key)
        if fut is not None and not fut.done():
            fut.set_result(self._result)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        intr = self._intr
        if intr.error is not None:
            self._complete()
        elif self._mode is WaitMode.STREAM:
            self._settle()
        elif self._mode is WaitMode.SLICED:
            self._sliced_wait()
        else:
            intr.wait_until(lambda: self._done)
            self._complete()
        return True

    def _sliced_wait(self) -> None:
        # Counted in flight (a rank blocked here is never the one blamed for a hang) once its
        # first slice has passed, from when the wait began: most collectives end within it,
        # and then cost no bookkeeping; the hang detector works in seconds.
        t0 = time.monotonic()
        slice_s = _FIRST_SLICE_S
        ok = False
        while True:
            try:
                self._inner.wait(timedelta(seconds=slice_s))
                ok = True
                break
            except RuntimeError as e:
                if str(e) != _TIMED_OUT:  # the collective itself failed
                    self._intr.fail(f"collective failed: {e}", self._gen)
                    break
            if self._done or self._intr.error is not None:
                break
            self._track(t0)
            if self._done:  # its epoch failed as it was counted
                break
            slice_s = min(slice_s * 2, _MAX_SLICE_S)
        self._complete(ok)

    def is_completed(self) -> bool:
        if self._done or self._intr.error is not None:
            return True
        try:
            done = bool(self._inner.is_completed())
        except RuntimeError:
            return True  # failed: wait() latches it
        if done and self._has_post:
            self.wait()  # runs the post step, or waits for whoever runs it: the result is in place
        return done

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
        try:
            inner_fut = None if self._mode is WaitMode.THREAD else self._inner.get_future()
        except RuntimeError:  # e.g. gloo's reduce_scatter_single has no future
            inner_fut = None
        if inner_fut is not None:
            inner_fut.add_done_callback(self._on_future)
        else:
            self._settle_in_pool()
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


class CollectiveObserver(Protocol):
    """Told of every collective a checked group is about to issue (launcher.worker.collective_check)."""

    def before(self, op: str, ins: Any, label: str) -> None: ...


class StableGroup(PyProcessGroup):
    """One rank's view of a group whose backend is replaced at every epoch."""

    def __init__(self, name: str, ranks: list[int], rank: int, intr: Interrupts, store_key: str | None = None) -> None:
        super().__init__(ranks.index(rank), len(ranks))
        self.label, self.ranks, self.global_rank = name, list(ranks), rank
        # Where its ranks meet in an epoch's store: the label, unless the group replaces one
        # of another width in this process (a resize: c10d names must stay unique here, while
        # a newcomer that never had the old group names it plainly).
        self.store_key = store_key or name
        self._intr = intr
        self._inner: Any = None  # the epoch's backend ProcessGroup
        self.kind: str | None = None  # the epoch backend's name ("gloo", "nccl"): how its works are waited on
        self.allow = False  # collectives allowed (joined and attached)
        self.backend: str | None = None  # None: the job's backend; "gloo" for host-memory traffic on a GPU job
        self.timeout_s: float | None = None  # None: the job's collective timeout
        self.check: CollectiveObserver | None = None  # the job's groups (not resild's host groups)

    @property
    def pg(self) -> Any:
        """The current epoch's backend ProcessGroup (None between epochs): for resild's own
        point-to-point and collective traffic that needs no StableGroup bookkeeping."""
        return self._inner

    @property
    def intr(self) -> Interrupts:
        """The epoch's failure latch this group's collectives report to."""
        return self._intr

    # torch reads these
    @property
    def group_name(self) -> GroupName:
        return GroupName(self.label)

    def getBackendName(self) -> str:
        return "resild"

    def set_backend(self, inner: Any) -> None:
        self._inner = inner
        self.kind = None if inner is None else str(inner.name())

    def _run(
        self, result: Any, op: Callable[[Any], Any], untimed: bool = False, name: str = "", ins: Any = None
    ) -> dist.Work:
        """Issue one collective on this epoch's backend (`op(backend)`), managed."""
        return self._start(result, lambda g: (op(g), None), untimed, name, ins)

    def _start(
        self,
        result: Any,
        op: Callable[[Any], tuple[Any, Callable[[], None] | None]],
        untimed: bool,
        name: str = "",
        ins: Any = None,
    ) -> dist.Work:
        """`op(backend)` -> (the backend's Work, a step to run once it has succeeded).
        `name`: the collective (none for point-to-point), told to `check` first."""
        if self.check is not None and name and self.allow:
            self.check.before(name, ins, self.label)
        if not self.allow:
            raise NotJoined(
                f"resild: a collective on group {self.label!r} before job.attach(): under resild a spare joins a "
                "running job, so nothing may communicate before attach (construct DDP with init_sync=False; "
                "resild makes replicas equal at attach)"
            )
        # The backend is read before the epoch is checked: a backend of the next epoch is
        # only installed after this epoch's error was latched, and the error is cleared with
        # a new generation (under the lock `stale()` reads them with).
        inner = self._inner
        if self._intr.stale():
            raise StaleEpoch(f"a collective on {self.label!r} from a thread of an epoch that has passed")
        if self._intr.error is not None or inner is None:
            return _DoneWork(result)
        try:
            work, post = op(inner)
        except Exception as e:  # e.g. gloo refusing to start on a dead connection
            self._intr.fail(f"collective failed to start: {e}")
            return _DoneWork(result)
        return ManagedWork(work, result, self._intr, wait_mode(self.kind, untimed), post)

    def _reduce_scatter_tensors(
        self, result: Any, outs: list[Any], ins: list[Any], opts: Any, native: Callable[[Any], Any], name: str
    ) -> dist.Work:
        """On gloo, one tensor's reduce-scatter is issued as the all-reduce gloo runs for it
        (`gloo_reduce_scatter`), so it is waited on in slices (SLICED) rather than in a
        helper thread: ~0.9 ms less per collective on 2 busy cores (bench/collective_cost.py)."""
        if self.kind != "gloo" or len(outs) != 1:
            return super()._reduce_scatter_tensors(result, outs, ins, opts, native, name)
        return self._start(result, lambda g: gloo_reduce_scatter(g, outs[0], ins[0], opts), False, name, ins)


def exchange_rows(world: StableGroup, device: torch.device) -> Callable[[list[int]], list[list[int]] | None]:
    """All-gather one row of integers from every rank of `world` (unchecked, managed):
    None if the epoch failed meanwhile."""

    def exchange(row: list[int]) -> list[list[int]] | None:
        dev = device if world.kind == "nccl" else torch.device("cpu")
        inp = torch.tensor(row, dtype=torch.int64, device=dev)
        out = torch.zeros(world.size() * len(row), dtype=torch.int64, device=dev)
        world._start(out, lambda g: (allgather_into(g, out, inp), None), False).wait()
        if world.intr.error is not None:
            return None
        return [list(r) for r in out.view(world.size(), len(row)).tolist()]

    return exchange


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
    GPU, wrapped in a c10d ProcessGroup so every collective name resolves.

    `local_store_client` and `node_ranks` (this node's ranks in the epoch being formed):
    a group whose ranks all live on this node forms through the node process's store
    (launcher/node/node_store.py), and the controller never hears of it."""

    def __init__(
        self,
        backend: str,
        store_client: Callable[[], Any],
        timeout_s: float,
        gloo_host: str | None = None,
        local_store_client: Callable[[], Any] | None = None,
        node_ranks: Callable[[], frozenset[int]] | None = None,
    ) -> None:
        self.backend, self._store_client, self.timeout_s, self.gloo_host = backend, store_client, timeout_s, gloo_host
        self._local_store_client, self._node_ranks = local_store_client, node_ranks

    def node_local(self, group: StableGroup) -> bool:
        if self._local_store_client is None or self._node_ranks is None:
            return False
        return set(group.ranks) <= self._node_ranks()

    def build(self, epoch: int, group: StableGroup) -> Any:
        """Blocking (gloo connects a full mesh here); run it off the training thread.
        Each formation gets its own store client: an abandoned one blocks in
        store.wait() holding its client, which would stall the next epoch."""
        client = self._local_store_client if self.node_local(group) else self._store_client
        assert client is not None
        store = PrefixStore(f"resild/e{epoch}/{group.store_key}/", client())
        timeout = timedelta(seconds=self.timeout_s_for(group))
        backend = group.backend or self.backend
        return backend_group(backend, store, group.rank(), group.size(), timeout, self.gloo_host)

    def timeout_s_for(self, group: StableGroup) -> float:
        return group.timeout_s or self.timeout_s


def abort(inner: Any) -> None:
    """NCCL: interrupts pending kernels (ncclCommAbort); gloo: returns at once
    without interrupting a pending recv, which is why waits watch the epoch."""
    try:
        inner.abort()
    except Exception:
        pass
