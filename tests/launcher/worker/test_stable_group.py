"""How a rank waits on its collectives (`WaitMode`): a normal completion costs one backend
wait, a hung one is released by the epoch, NCCL waits never block the CPU and are
interrupted through the communicator's abort."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from launcher.worker.recovery import RecoverySequence
from launcher.worker.stable_group import (
    GroupFactory,
    Interrupts,
    ManagedWork,
    StableGroup,
    StaleEpoch,
    WaitMode,
    wait_mode,
)
from launcher.worker.torch_private import backend_group, hash_store

pytestmark = pytest.mark.timeout(60)


def gloo_groups(n: int) -> list[Any]:
    """Every rank of an n-rank gloo group, in this process."""
    store = hash_store()
    out: list[Any] = [None] * n

    def build(r: int) -> None:
        out[r] = backend_group("gloo", store, r, n, timedelta(seconds=20), "127.0.0.1")

    ts = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def two_rank_gloo() -> list[Any]:
    """Both ranks of a 2-rank gloo group, in this process (gloo connects in the constructor)."""
    return gloo_groups(2)


def rank0_world() -> tuple[StableGroup, Interrupts, list[Any]]:
    """Rank 0's StableGroup over a 2-rank gloo group whose rank 1 never joins a collective
    (both backends returned: rank 1's must stay referenced while the test runs)."""
    backends = two_rank_gloo()
    intr = Interrupts()
    g = StableGroup("world", [0, 1], 0, intr)
    g.set_backend(backends[0])
    g.allow = True
    return g, intr, backends


def test_the_wait_mode_follows_the_backend() -> None:
    assert wait_mode("nccl", False) is WaitMode.STREAM
    assert wait_mode("nccl", True) is WaitMode.STREAM
    assert wait_mode("gloo", False) is WaitMode.SLICED
    assert wait_mode("gloo", True) is WaitMode.THREAD


def test_gloo_list_reduce_scatter_is_waited_on_in_a_helper_thread() -> None:
    r0, _r1 = two_rank_gloo()
    g = StableGroup("world", [0, 1], 0, Interrupts())
    g.set_backend(r0)
    g.allow = True
    w = HUNG_OPS["reduce_scatter"](g)
    assert isinstance(w, ManagedWork) and w._mode is WaitMode.THREAD
    g.intr.fail("done")


def run_ranks(n: int, fn: Any) -> list[Any]:
    out: list[Any] = [None] * n
    ts = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r))) for r in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


@pytest.mark.parametrize("op", [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX])
def test_a_gloo_reduce_scatter_is_waited_on_in_slices_and_bitwise_the_backends_own(op: Any) -> None:
    """gloo's reduce-scatter Work ignores a wait's timeout; resild issues it as the all-reduce
    gloo itself runs, whose Work honours it. Same bits as gloo's own, at 3 ranks (a ring
    where each element's summation order depends on its chunk)."""
    n = 3
    backends = gloo_groups(n)
    groups = []
    for r in range(n):
        g = StableGroup("world", list(range(n)), r, Interrupts())
        g.set_backend(backends[r])
        g.allow = True
        groups.append(g)
    inputs = [torch.randn(n * 1001, generator=torch.Generator().manual_seed(r)) * 1e3 for r in range(n)]
    opts = torch.distributed.ReduceScatterOptions()
    opts.reduceOp = op

    def ours(r: int) -> torch.Tensor:
        out = torch.zeros(1001)
        w = groups[r].reduce_scatter_single(out, inputs[r], opts)
        assert isinstance(w, ManagedWork) and w._mode is WaitMode.SLICED
        w.wait()
        return out

    def gloos(r: int) -> torch.Tensor:
        out = torch.zeros(1001)
        backends[r]._reduce_scatter_base(out, inputs[r].clone(), opts).wait()
        return out

    mine, theirs = run_ranks(n, ours), run_ranks(n, gloos)
    for r in range(n):
        assert torch.equal(mine[r], theirs[r]), r
    assert not any(torch.equal(mine[0], inputs[r].chunk(n)[0]) for r in range(n))  # reduced, not copied
    groups[0].intr.fail("done")


def test_a_gloo_reduce_scatter_is_done_when_polled_and_its_future_carries_the_result() -> None:
    backends = two_rank_gloo()
    groups = []
    for r in range(2):
        g = StableGroup("world", [0, 1], r, Interrupts())
        g.set_backend(backends[r])
        g.allow = True
        groups.append(g)

    def issue(r: int) -> tuple[Any, torch.Tensor]:
        out = torch.zeros(2)
        return groups[r].reduce_scatter_single(out, torch.tensor([1.0, 2.0, 3.0, 4.0]) * (r + 1)), out

    (w0, out0), (w1, out1) = run_ranks(2, issue)
    fut = w1.get_future()
    deadline = time.monotonic() + 10
    while not w0.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert w0.is_completed()
    assert out0.tolist() == [3.0, 6.0]  # in place once is_completed() says so, without wait()
    fut.wait()
    assert out1.tolist() == [9.0, 12.0]


def test_a_reduce_scatter_cut_off_by_a_new_epoch_leaves_its_output_alone() -> None:
    g, intr, _peers = rank0_world()
    out = torch.full((2,), 7.0)
    w = g.reduce_scatter_single(out, torch.ones(4))  # rank 1 never joins
    intr.fail("epoch 2 announced")
    w.wait()
    assert out.tolist() == [7.0, 7.0] and w.is_completed()


def test_a_completed_gloo_collective_is_waited_on_without_counting_in_flight() -> None:
    intr = Interrupts()
    g = StableGroup("world", [0], 0, intr)
    g.set_backend(backend_group("gloo", hash_store(), 0, 1, timedelta(seconds=10), None))
    g.allow = True
    assert g.kind == "gloo"
    t = torch.ones(3)
    w = g.allreduce([t])
    assert isinstance(w, ManagedWork)
    w.wait()
    assert w.is_completed() and w.is_success()
    assert intr.oldest_in_flight_s(time.monotonic()) == 0.0 and not intr._works
    intr.fail("epoch 2 announced")  # after the collective: what it computed stays valid, and says so
    assert w.succeeded


# Every collective FSDP2, DDP and the recovery issue on gloo. gloo's reduce-scatter Works
# ignore a wait's timeout (torch 2.13): waited on in slices, a survivor stayed blocked behind
# a dead peer until its connection closed, and the hang detector blamed the survivor. Now a
# one-tensor reduce-scatter is issued as an all-reduce, and the list form waits in a thread.
HUNG_OPS = {
    "allreduce": lambda g: g.allreduce([torch.ones(4)]),
    "all_gather_single": lambda g: g.all_gather_single(torch.zeros(8), torch.ones(4)),
    "allgather": lambda g: g.allgather([[torch.zeros(4), torch.zeros(4)]], [torch.ones(4)]),
    "reduce_scatter_single": lambda g: g.reduce_scatter_single(torch.zeros(2), torch.ones(4)),
    "reduce_scatter": lambda g: g.reduce_scatter([torch.zeros(2)], [[torch.ones(2), torch.ones(2)]]),
    "broadcast": lambda g: g.broadcast([torch.ones(4)]),
}


@pytest.mark.parametrize("op", sorted(HUNG_OPS))
def test_a_hung_gloo_collective_counts_in_flight_and_is_released_by_a_new_epoch(op: str) -> None:
    g, intr, _peers = rank0_world()
    w = HUNG_OPS[op](g)  # rank 1 never joins
    done = threading.Event()
    threading.Thread(target=lambda: (w.wait(), done.set()), daemon=True).start()
    time.sleep(0.2)
    assert not done.is_set()
    assert intr.oldest_in_flight_s(time.monotonic()) >= 0.1  # reported as waiting: never blamed for the hang
    t0 = time.monotonic()
    intr.fail("epoch 2 announced")
    assert done.wait(5)
    assert time.monotonic() - t0 < 1.0  # within a wait slice, not the collective timeout (20 s)
    assert intr.error == "epoch 2 announced" and not intr._works
    assert not w.succeeded  # released, not completed: its output is not a result


def test_a_future_asked_for_after_the_epoch_failed_is_done_at_once() -> None:
    # DDP's reducer issues a bucket's all-reduce and asks for its future right after; when
    # the epoch fails in between, fail() has released every work it knew and nothing would
    # release this one: the survivor's backward waited out gloo's timeout (seen as a hang
    # after epoch 2 in test_ddp_amp_accumulation_clipping_recovered_bitwise[kill:node1@9]).
    g, intr, _peers = rank0_world()
    w = g.allreduce([torch.ones(4)])  # rank 1 never joins
    intr.fail("epoch 2 announced")
    fut = w.get_future()
    assert fut.done() and not intr._works
    intr.clear()  # epoch 2
    old = g.allreduce([torch.ones(4)])  # issued in epoch 2 ...
    intr.clear()  # ... its future asked for in epoch 3
    assert old.get_future().done() and not intr._works


def test_a_wait_that_is_not_a_collective_stays_in_flight_across_a_new_epoch() -> None:
    """RecoverySequence's own waits (forming, aborting the old backends) may still block after the
    epoch is interrupted: they count until their owner ends them."""
    intr = Interrupts()
    token = intr.begin_wait()
    time.sleep(0.05)
    intr.fail("epoch 2 announced")
    assert intr.oldest_in_flight_s(time.monotonic()) >= 0.05
    intr.done(token)
    assert intr.oldest_in_flight_s(time.monotonic()) == 0.0


def test_a_hung_gloo_receive_is_released_by_a_new_epoch() -> None:
    g, intr, _peers = rank0_world()
    w = g.recv([torch.zeros(4)], 1, 7)  # nothing is ever sent
    done = threading.Event()
    threading.Thread(target=lambda: (w.wait(), done.set()), daemon=True).start()
    time.sleep(0.1)
    assert not done.is_set() and intr.oldest_in_flight_s(time.monotonic()) > 0
    intr.fail("epoch 2 announced")
    assert done.wait(5)


class FakeNcclWork:
    """What the runtime sees of an NCCL work: a wait that only orders streams, and a GPU
    event that says when the kernel finished."""

    def __init__(self) -> None:
        self.waits: list[tuple[Any, ...]] = []
        self.finished = False

    def wait(self, *args: Any) -> bool:
        self.waits.append(args)
        return True

    def is_completed(self) -> bool:
        return self.finished

    def get_future(self) -> torch.futures.Future[Any]:
        f: torch.futures.Future[Any] = torch.futures.Future()
        f.set_result(None)  # NCCL marks its future complete at enqueue (CUDA-aware)
        return f


def test_an_nccl_wait_never_blocks_the_cpu_and_counts_in_flight_until_the_gpu_is_done() -> None:
    intr = Interrupts()
    inner = FakeNcclWork()
    w = ManagedWork(inner, None, intr, WaitMode.STREAM)
    w.wait()
    assert inner.waits == [()]  # no timeout: a timed NCCL wait would spin the CPU on the GPU
    assert intr.oldest_in_flight_s(time.monotonic() + 1.0) >= 1.0  # the kernel is still running
    inner.finished = True
    assert intr.oldest_in_flight_s(time.monotonic()) == 0.0
    w2 = ManagedWork(FakeNcclWork(), "out", intr, WaitMode.STREAM)
    assert w2.get_future().wait() == "out"


class FakeNcclGroup:
    def __init__(self) -> None:
        self.aborted_on: list[str] = []

    def name(self) -> str:
        return "nccl"

    def abort(self) -> None:
        self.aborted_on.append(threading.current_thread().name)


def test_a_new_epoch_aborts_the_nccl_communicators_of_the_old_one_off_the_callers_thread() -> None:
    intr = Interrupts()
    rec = RecoverySequence(intr, GroupFactory("nccl", hash_store, 10.0), torch.device("cpu"), 0.0)
    old = FakeNcclGroup()
    g = StableGroup("world", [0], 0, intr)
    g.set_backend(old)
    rec.groups["world"] = g
    intr.fail("epoch 2 announced")
    deadline = time.monotonic() + 5
    while not old.aborted_on and time.monotonic() < deadline:
        time.sleep(0.01)
    assert old.aborted_on == ["resild-abort"]
    # The next epoch's communicator is never aborted by the old epoch's interruption.
    new = FakeNcclGroup()
    g.set_backend(new)
    intr.clear()
    time.sleep(0.05)
    assert new.aborted_on == [] and old.aborted_on == ["resild-abort"]


def test_a_post_step_runs_once_when_a_future_and_a_wait_both_complete_the_work() -> None:
    intr = Interrupts()
    ran: list[int] = []
    inner = FakeNcclWork()  # completed: its future is done at once, its wait returns
    w = ManagedWork(inner, "out", intr, WaitMode.SLICED, post=lambda: ran.append(1))
    fut = w.get_future()  # the done callback completes the work, running the post step
    w.wait()
    assert fut.done() and fut.value() == "out" and ran == [1]
    skipped: list[int] = []
    w2 = ManagedWork(FakeNcclWork(), None, intr, WaitMode.SLICED, post=lambda: skipped.append(1))
    intr.fail("epoch 2 announced")
    w2.wait()
    assert skipped == []  # the epoch failed first: its buffers are garbage, nothing is copied


def test_a_post_step_that_raises_latches_and_still_completes_the_work() -> None:
    intr = Interrupts()

    def bad() -> None:
        raise RuntimeError("shape mismatch")

    w = ManagedWork(FakeNcclWork(), "out", intr, WaitMode.SLICED, post=bad)
    t0 = time.monotonic()
    fut = w.get_future()  # completed on the callback path: nothing raises there either
    w.wait()  # nothing raises into user code
    # torch swallows what a done-callback raises, pytest-timeout's included: a deadlock on
    # the work's own lock would only show as time
    assert time.monotonic() - t0 < 5.0
    assert fut.done() and w.is_completed() and not intr._works
    assert intr.error is not None and "shape mismatch" in intr.error


def test_a_late_work_of_an_old_epoch_copies_nothing_into_the_new_one() -> None:
    intr = Interrupts()
    ran: list[int] = []
    w = ManagedWork(FakeNcclWork(), None, intr, WaitMode.SLICED, post=lambda: ran.append(1))
    intr.clear()  # a new epoch began before the old work ended
    w.wait()
    assert ran == [] and w.is_completed()


def test_a_bad_gloo_reduce_scatter_fails_to_start_as_gloos_own_would() -> None:
    g, intr, _peers = rank0_world()
    w = g.reduce_scatter_single(torch.zeros(3), torch.ones(4))  # 3 x 2 ranks != 4
    w.wait()  # nothing raises: the step is lost, the error latched
    assert intr.error is not None and "1/2 of input" in intr.error


def test_a_coalesced_gloo_reduce_scatter_of_one_tensor_completes_with_its_list() -> None:
    backends = two_rank_gloo()
    outs = [[torch.zeros(2)] for _ in range(2)]

    def issue(r: int) -> Any:
        g = StableGroup("world", [0, 1], r, Interrupts())
        g.set_backend(backends[r])
        g.allow = True
        w = g.reduce_scatter_single_coalesced(outs[r], [torch.ones(4)], torch.distributed.ReduceScatterOptions())
        return w.get_future().wait()

    got = run_ranks(2, issue)
    assert isinstance(got[0], list) and got[0][0].tolist() == [2.0, 2.0]


def test_a_thread_pinned_to_a_failed_epoch_never_reaches_the_next_epochs_backend() -> None:
    # Issue 41: a disk checkpoint's writer thread of epoch 1 went on across the recovery and
    # issued its next collective on epoch 2's backend, where it paired with a peer's first
    # collective of a new save (an empty buffer unpickled there; the writer waited forever).
    old, new = two_rank_gloo(), two_rank_gloo()
    intrs = [Interrupts(), Interrupts()]
    groups = [StableGroup("resild-checkpoint", [0, 1], r, intrs[r]) for r in (0, 1)]
    for r in (0, 1):
        groups[r].set_backend(old[r])
        groups[r].allow = True
    stale = torch.full((1,), 100.0)
    go, issued = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def writer_of_epoch_1() -> None:
        intrs[0].pin(intrs[0].gen)
        go.wait(10)
        try:
            groups[0].allreduce([stale]).wait()  # after the recovery: must not go out
        except StaleEpoch as e:
            raised.append(e)
        issued.set()

    t = threading.Thread(target=writer_of_epoch_1)
    t.start()
    for r in (0, 1):  # the recovery: fail, retire, form epoch 2, clear
        intrs[r].fail("a new epoch")
        groups[r].set_backend(None)
        groups[r].set_backend(new[r])
        intrs[r].clear()
    go.set()
    assert issued.wait(5) and raised and stale.item() == 100.0  # refused at once, its buffer untouched
    t.join(5)
    # Epoch 2's own collectives pair with each other, not with the stale one.
    got = [torch.full((1,), 1.0), torch.full((1,), 2.0)]
    peer = threading.Thread(target=lambda: groups[1].allreduce([got[1]]).wait())
    peer.start()
    groups[0].allreduce([got[0]]).wait()
    peer.join(10)
    assert [g.item() for g in got] == [3.0, 3.0]
    assert intrs[0].error is None and intrs[1].error is None
