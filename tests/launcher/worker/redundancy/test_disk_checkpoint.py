"""Disk checkpoints (launcher.worker.redundancy.disk_checkpoint) in real processes: 2 ranks, gloo,
FSDP2 on CPU, DCP writes in a background thread over a group of its own."""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from launcher.worker.data import ResumableLoader
from launcher.worker.redundancy.disk_checkpoint import (
    COMPLETE,
    DiskCheckpointer,
    complete_steps,
    prune_dir,
    step_dir,
)
from launcher.worker.stable_group import Interrupts, StableGroup, register
from launcher.worker.torch_private import PrefixStore, backend_group
from launcher.worker.train_state import TrainState
from launcher.worker.transport.codec import flatten

pytestmark = pytest.mark.timeout(120)

WORLD = 2
TIMEOUT = timedelta(seconds=20)


# ---- harness: two spawned ranks around a TCPStore held by the test -------------------------
def _run_ranks(target: Callable[..., None], *args: Any, timeout_s: float = 90.0) -> list[int | None]:
    """Run `target(rank, port, *args)` in WORLD spawned processes; their exit codes.
    Whatever happens, no process outlives the test."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, store.port, *args)) for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _init(rank: int, port: int) -> Any:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    return store


# ---- a small FSDP2 job: dropout, a python-random draw, a stateful loader ------------------
def _job(init_seed: int, rank: int) -> tuple[TrainState, ResumableLoader]:
    torch.manual_seed(init_seed)  # every rank builds the same model, as FSDP2 expects
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 3),  # 3 rows over 2 ranks: uneven shards
    )
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 16, generator=g)
    ds = TensorDataset(x, torch.tanh(x[:, :3]))
    sampler: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=True, seed=0)
    loader = ResumableLoader(StatefulDataLoader(ds, batch_size=8, sampler=sampler))
    torch.manual_seed(100 + rank)  # dropout differs per rank: each rank's aux is its own
    random.seed(200 + rank)
    return TrainState(model, opt, sched, extra=loader), loader


def _train(ts: TrainState, loader: ResumableLoader, start: int, stop: int, ck: DiskCheckpointer | None = None) -> None:
    """Steps start..stop-1; after step s, s+1 steps are committed (what `due` sees)."""
    for s in range(start, stop):
        x, y = next(loader)  # the loader's epochs run out after 6 batches: step 6 starts epoch 1
        ts.optimizer.zero_grad()
        loss = F.mse_loss(ts.model(x), y) * (1.0 + random.random())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ts.model.parameters(), 1.0)
        ts.optimizer.step()
        ts.scheduler.step()
        if ck is not None and ck.due(s + 1):
            ck.save(s + 1, ts, ts.capture_aux())


def _full(ts: TrainState) -> tuple[Any, ...]:
    """Unsharded model, optimizer and scheduler state, copied (the optimizer's plain
    `step` tensors come back as the live ones)."""
    opts = StateDictOptions(full_state_dict=True)
    full = (
        get_model_state_dict(ts.model, options=opts),
        get_optimizer_state_dict(ts.model, ts.optimizer, options=opts),
        ts.scheduler.state_dict(),
    )
    return tuple(copy.deepcopy(x) for x in full)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _resume(ck: DiskCheckpointer, step: int, seed: int, rank: int, rewind: bool = True) -> TrainState:
    """A fresh model, optimizer, loader and RNG (what a crashed job starts with), then the checkpoint."""
    ts, loader = _job(seed, rank)
    torch.manual_seed(seed * 1000 + rank)
    aux = ck.load(step, ts)
    if rewind:
        ts.rewind_aux(aux)
    _train(ts, loader, step, 10)
    return ts


# ---- the distributed scenarios share one pair of processes (importing torch costs seconds) --
def _worker(rank: int, port: int, root: str) -> None:
    store = _init(rank, port)
    _resume_phase(rank, Path(root) / "resume")
    (Path(root) / f"resume-ok-rank{rank}").touch()
    _staged_phase(rank, Path(root) / "staged")
    (Path(root) / f"staged-ok-rank{rank}").touch()
    _killed_phase(rank, store, Path(root) / "killed")  # ends the process


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[int | None], Path]:
    root = tmp_path_factory.mktemp("disk_checkpoint")
    return _run_ranks(_worker, str(root)), root


# ---- 1: save asynchronously, lose everything, load, continue bitwise -----------------------
def _resume_phase(rank: int, directory: Path) -> None:
    ts, loader = _job(0, rank)
    _train(ts, loader, 0, 10)
    reference = _full(ts)

    group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # the checkpointer's own
    ck = DiskCheckpointer(directory, every=2, rank=rank, world_size=WORLD, group=group)
    ts, loader = _job(0, rank)
    saved_aux: dict[int, tuple[bytes, torch.Tensor]] = {}
    real_save = ck.save

    def save(step: int, train: TrainState, aux: dict[str, Any]) -> None:
        skel, buf = flatten(aux)
        saved_aux[step] = (skel, buf.clone())
        real_save(step, train, aux)

    ck.save = save  # type: ignore[method-assign]
    _train(ts, loader, 0, 6, ck)
    assert ck.wait(60.0), "the last save never finished"
    assert (ck.stats.started, ck.stats.complete, ck.stats.failed) == (3, 3, 0), ck.stats
    assert ck.newest_complete() == 6

    # Crash: nothing in memory survives. Load the newest complete checkpoint.
    step = ck.newest_complete()
    assert step is not None
    fresh, _ = _job(1, rank)
    aux = ck.load(step, fresh)
    skel, buf = flatten(aux)
    assert skel == saved_aux[6][0] and torch.equal(buf, saved_aux[6][1]), "this rank's aux did not round-trip"
    assert _same(_full(_resume(ck, 6, 1, rank)), reference), "resumed from step 6, not bitwise"

    # The newest save interrupted (no COMPLETE): never chosen; the one before is.
    if rank == 0:
        (step_dir(directory, 6) / COMPLETE).unlink()
    dist.barrier()
    assert ck.newest_complete() == 4
    assert _same(_full(_resume(ck, 4, 2, rank)), reference), "resumed from step 4, not bitwise"
    # The check can fail: without the RNG and loader position the run differs.
    assert not _same(_full(_resume(ck, 4, 3, rank, rewind=False))[0], reference[0])


def test_fsdp2_async_save_then_load_continues_bitwise(ranks: tuple[list[int | None], Path]) -> None:
    _, root = ranks
    assert [(root / f"resume-ok-rank{r}").exists() for r in range(WORLD)] == [True, True], "see the ranks' stderr"
    assert complete_steps(root / "resume") == [2, 4]
    assert (step_dir(root / "resume", 6) / ".metadata").is_file()  # written, but not marked complete


# ---- 1b: the checkpoint is what was committed, whatever the next steps do to the live state --
def _staged_phase(rank: int, directory: Path) -> None:
    ts, loader = _job(0, rank)
    _train(ts, loader, 0, 2)
    committed = _full(ts)
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    ck = DiskCheckpointer(directory, every=2, rank=rank, world_size=WORLD, group=group)
    gate = threading.Event()
    write = dcp.FileSystemWriter.write_data

    def gated(self: Any, *a: Any, **k: Any) -> Any:
        assert gate.wait(30.0)
        return write(self, *a, **k)

    dcp.FileSystemWriter.write_data = gated  # type: ignore[method-assign]
    try:
        ck.save(2, ts, ts.capture_aux())
        assert ck.busy()
        _train(ts, loader, 2, 4)  # two more steps while the write is held back
        with torch.no_grad():
            for p in ts.model.parameters():
                p.add_(1.0)  # and every live value changed in place
        gate.set()
        assert ck.wait(30.0) and ck.stats.complete == 1, ck.stats
    finally:
        dcp.FileSystemWriter.write_data = write  # type: ignore[method-assign]
    fresh, _ = _job(1, rank)
    ck.load(2, fresh)
    assert _same(_full(fresh), committed), "the checkpoint holds state from after the save was called"


def test_save_writes_the_state_as_staged(ranks: tuple[list[int | None], Path]) -> None:
    _, root = ranks
    assert [(root / f"staged-ok-rank{r}").exists() for r in range(WORLD)] == [True, True], "see the ranks' stderr"


# ---- 2: what counts as complete; pruning ---------------------------------------------------
def _fake(directory: Path, step: int, complete: bool, marker_step: int | None = None) -> Path:
    d = step_dir(directory, step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    if complete:
        (d / COMPLETE).write_text(json.dumps({"step": step if marker_step is None else marker_step}))
    return d


def test_newest_complete_ignores_partial_and_garbage_and_prune_keeps_newest(tmp_path: Path) -> None:
    for s in (2, 4, 8):
        _fake(tmp_path, s, complete=True)
    _fake(tmp_path, 6, complete=False)  # a save cut short, older than the newest complete
    _fake(tmp_path, 10, complete=False)  # newer: may be in flight
    _fake(tmp_path, 12, complete=True, marker_step=2)  # a copied directory: its marker names another step
    (step_dir(tmp_path, 14)).mkdir()
    (step_dir(tmp_path, 14) / COMPLETE).write_text('{"step": 14}')  # no DCP metadata
    (tmp_path / "step-00000016").write_text("a file, not a directory")
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-00000018.tmp").mkdir()
    (tmp_path / "step-42").mkdir()  # fewer than 8 digits: not ours
    (tmp_path / "notes.txt").write_text("keep me")
    ck = DiskCheckpointer(tmp_path, every=2, rank=0, world_size=2, group=None)  # type: ignore[arg-type]

    assert complete_steps(tmp_path) == [2, 4, 8]
    assert ck.newest_complete() == 8
    assert DiskCheckpointer(tmp_path / "nothing-here", 2, 0, 2, None).newest_complete() is None  # type: ignore[arg-type]
    assert [ck.due(s) for s in (0, 1, 2, 3, 4)] == [False, False, True, False, True]
    assert not DiskCheckpointer(tmp_path, 0, 0, 2, None).due(4)  # type: ignore[arg-type]

    DiskCheckpointer(tmp_path, 2, 1, 2, None).prune(keep=2)  # type: ignore[arg-type]  # rank 1: no-op
    assert complete_steps(tmp_path) == [2, 4, 8]
    ck.prune(keep=2)
    assert complete_steps(tmp_path) == [4, 8]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert "step-00000002" not in left and "step-00000006" not in left  # older complete, older partial
    for name in ("step-00000010", "step-00000012", "step-00000014", "step-00000016", "step-abc", "notes.txt"):
        assert name in left  # newer than the newest complete, or not a checkpoint of ours
    assert prune_dir(tmp_path, keep=1) == [4]
    assert complete_steps(tmp_path) == [8] and ck.newest_complete() == 8


def test_a_checkpoint_others_may_write_or_another_user_owns_is_never_loaded(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle the load runs: a planted or tampered one must not be read
    (issue 39, finding 7). Not complete, not loaded; the job's own older one still is."""
    import os

    for s in (2, 4, 6):
        _fake(tmp_path, s, complete=True)
    os.chmod(step_dir(tmp_path, 4) / ".metadata", 0o666)  # anyone could have replaced it
    os.chmod(step_dir(tmp_path, 6), 0o777)  # anyone could have put files there
    assert complete_steps(tmp_path) == [2]
    if os.getuid() == 0:  # another user's metadata, mode 0644
        os.chmod(step_dir(tmp_path, 4) / ".metadata", 0o644)
        os.chown(step_dir(tmp_path, 4) / ".metadata", 65534, 65534)
        assert complete_steps(tmp_path) == [2]


# ---- 3: a rank killed mid-write: rank 0 never marks the step complete ----------------------
def _killed_phase(rank: int, store: Any, directory: Path) -> None:
    ts, loader = _job(0, rank)
    # The runtime will hand the checkpointer a resild StableGroup of its own: DCP runs on it.
    intr = Interrupts()
    group = StableGroup("resild-checkpoint", list(range(WORLD)), rank, intr)
    group.set_backend(backend_group("gloo", PrefixStore("ckpt/", store), rank, WORLD, TIMEOUT, None))
    group.allow = True
    register(group, store)
    ck = DiskCheckpointer(directory, every=2, rank=rank, world_size=WORLD, group=group, intr=intr)
    _train(ts, loader, 0, 2, ck)
    assert ck.wait(60.0) and ck.stats.complete == 1, ck.stats

    if rank == 1:  # write this rank's file in full, then die before DCP's final gather
        import torch.distributed.checkpoint.filesystem as fs

        write = fs._write_files_from_queue

        def write_then_die(*a: Any, **k: Any) -> None:
            write(*a, **k)
            os._exit(17)

        fs._write_files_from_queue = write_then_die
    _train(ts, loader, 2, 4, ck)
    finished = ck.wait(60.0)
    if rank == 0:
        assert finished and ck.stats.failed == 1 and ck.stats.last_error, ck.stats
        assert ck.newest_complete() == 2
    os._exit(0 if rank == 0 else 3)  # a peer is dead: skip the process group's teardown


def test_rank_killed_mid_write_leaves_the_step_incomplete(ranks: tuple[list[int | None], Path]) -> None:
    codes, root = ranks
    assert codes == [0, 17], "rank 0 must see the save fail; rank 1 dies writing (see the ranks' stderr)"
    tmp_path = root / "killed"
    partial = step_dir(tmp_path, 4)
    assert (partial / "__1_0.distcp").is_file()  # rank 1's part was written...
    assert not (partial / COMPLETE).exists() and not (partial / ".metadata").exists()
    assert complete_steps(tmp_path) == [2]
    assert prune_dir(tmp_path, keep=1) == []  # newer than the newest complete: kept (might be in flight)
