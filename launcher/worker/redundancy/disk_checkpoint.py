"""Asynchronous disk checkpoints of the attached training state (torch.distributed.checkpoint).

The last line of defence: when every in-memory copy of some rank's state is lost
(no replica, no peer snapshot), or when a requeued/resubmitted job starts, the
ranks load the newest *complete* checkpoint in-process and go on.

Layout, one directory per step:

    DIR/step-00000042/__0_0.distcp ...   DCP's data files, one per rank
    DIR/step-00000042/.metadata          DCP's global metadata (rank 0, after every rank wrote)
    DIR/step-00000042/COMPLETE           rank 0, atomically, after DCP's save returned

Only a directory with COMPLETE is ever loaded: DCP's save returns on rank 0 only
after it gathered every rank's write result (each file fsynced), so COMPLETE
means every rank's part is on disk. A save cut short (a rank killed, a failed
collective, a full disk) leaves no COMPLETE and is ignored, then pruned.

What is saved: everything is a tensor in DCP's files, nothing else is written
but JSON, so no pickle of ours (DCP's own `.metadata` is a pickle it reads back).
- `model/...`, `optim/...`, `sched/...`, `scaler/...`: the tensors of the model's
  state dict and the optimizer's (torch.distributed.checkpoint.state_dict, which
  handles FSDP2 and plain modules alike). FSDP2 shards are saved as DTensors,
  not local tensors, so DCP can reshard them at load.
- `meta/skeleton` (rank 0): the JSON of the same state with each tensor replaced
  by its key (param groups, scheduler and scaler values, the step), as uint8.
- `aux/rank{r}`: rank r's own aux (RNG, data-loader position, DDP buckets), which
  differs per rank: `transport.codec.flatten`'s JSON skeleton and byte buffer packed
  into one uint8 tensor under the rank's own key.

Threads: `save` stages (copies to host memory, so the next optimizer step cannot
tear the checkpoint) on the training thread, then `dcp.save` runs in a thread of
our own. The training thread never waits on a disk: the job starts a save only when
the commit vote said no rank is still writing one (checkpoint_cadence). DCP's save
does collectives (plan gather/scatter, the final gather of write results); they run
on that thread, on `group`, which nothing else may use: never the default group,
which the training thread drives at the same time. (`dcp.async_save` would run them
on its executor thread in the same way; our own thread also writes COMPLETE after
the save and keeps the timings.) One more all-reduce on `group` ends each save:
rank 0 tells every rank whether it wrote COMPLETE, so on every rank `wait()`
returning means the step is decided.

A save that a recovery abandons may still be running (its file system slow) when the
new epoch's group exists: its thread is pinned to its epoch (`Interrupts.pin`), so its
later collectives raise `StaleEpoch` instead of pairing with the new epoch's (issue 41).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from launcher.worker.redundancy.checkpoint_faults import Faults
from launcher.worker.stable_group import Interrupts
from launcher.worker.torch_private import dtensor_like
from launcher.worker.train_state import TrainState
from launcher.worker.transport.codec import flatten, unflatten
from resild.wire.own_dir import NotOwnError, check_own_dir, check_own_file

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = ()  # type: ignore[assignment,misc]

log = logging.getLogger("resild.checkpoint")

COMPLETE = "COMPLETE"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SKELETON_KEY = "meta/skeleton"
_LEN_BYTES = 8  # aux tensor: [skeleton length, int64][skeleton JSON][transport.codec buffer]


class CheckpointError(RuntimeError):
    """A save or load DCP failed on some rank (DCP's own CheckpointException is a
    BaseException, which `except Exception` lets through: it once killed the writer
    thread with its stats never told)."""


def _dcp_error(e: CheckpointException) -> CheckpointError:
    """One line per failed rank, its exception only (DCP's message is every traceback)."""
    parts = [f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _tb) in sorted(e.failures.items())]
    return CheckpointError("; ".join(parts) or "DCP failed")


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}"


def _step_dirs(directory: Path) -> dict[int, Path]:
    """step -> directory, for every well-named directory (complete or not); the rest is ignored."""
    out: dict[int, Path] = {}
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return out
    for p in entries:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out[int(m.group(1))] = p
    return out


def _is_complete(path: Path, step: int) -> bool:
    """COMPLETE names its step (a copied or renamed directory does not pass), DCP's metadata
    is there, and both are this user's alone to write (`_untrusted`)."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(marker, dict) and marker.get("step") == step and (path / ".metadata").is_file()):
        return False
    why = _untrusted(path)
    if why is not None:
        log.warning("disk checkpoint of step %d not loaded: %s", step, why)
    return why is None


def _untrusted(path: Path) -> str | None:
    """Why a checkpoint's files are not to be loaded: DCP's `.metadata` is a pickle, run as
    code by the load; its directory and it must be this user's and writable by no other."""
    try:
        check_own_dir(path, "checkpoint directory")
        check_own_file(path / ".metadata", "checkpoint metadata (a pickle)")
    except NotOwnError as e:
        return str(e)
    return None


def complete_steps(directory: Path) -> list[int]:
    """Steps with a complete checkpoint in `directory`, oldest first. A pure read."""
    return sorted(s for s, p in _step_dirs(directory).items() if _is_complete(p, s))


def prune_dir(directory: Path, keep: int, protect: int | None = None) -> list[int]:
    """Delete complete checkpoints older than the newest `keep`, and partial ones older
    than the newest complete (a newer partial one may still be being written). Never
    touches `protect` (a save in flight) or names it does not own. -> steps deleted."""
    dirs = _step_dirs(directory)
    complete = sorted((s for s, p in dirs.items() if _is_complete(p, s)), reverse=True)
    newest = complete[0] if complete else None
    doomed = set(complete[max(keep, 1) :])
    if newest is not None:
        doomed |= {s for s in dirs if s < newest and s not in complete}
    doomed.discard(protect if protect is not None else -1)
    for s in sorted(doomed):
        # COMPLETE goes first: a directory half deleted (killed here) is partial, never loaded.
        (dirs[s] / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(dirs[s], ignore_errors=True)
    return sorted(doomed)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    # The rename (or unlink) itself must be durable before anyone trusts it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- state <-> (JSON skeleton, flat dict of tensors keyed by path) ------------------------
def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON skeleton of `obj` with every tensor replaced by its key; the tensors go to
    `tensors`. Keys are paths, equal on every rank for the same structure, which is what
    lets DCP match a DTensor's shards across ranks and deduplicate replicated tensors."""
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise ValueError(f"two tensors of the training state map to checkpoint key {path!r}")
        tensors[path] = obj
        return {"__t": path}
    if isinstance(obj, dict):
        return {"__d": [[_key(k), _split(v, _sub(path, k), tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, _sub(path, i), tensors) for i, v in enumerate(obj)]
        return {"__l": items} if isinstance(obj, list) else {"__tu": items}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint state of type {type(obj).__name__} at {path!r}")


def _sub(path: str, k: Any) -> str:
    return f"{path}/{k}" if path else str(k)


def _key(k: Any) -> list[Any]:
    if isinstance(k, bool) or not isinstance(k, (int, str)):
        raise TypeError(f"state dict key {k!r} must be int or str")
    return ["i", k] if isinstance(k, int) else ["s", k]


def _join(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if "__t" in node:
            return tensors[node["__t"]]
        if "__d" in node:
            return {(k if kt == "s" else int(k)): _join(v, tensors) for (kt, k), v in node["__d"]}
        if "__l" in node:
            return [_join(v, tensors) for v in node["__l"]]
        if "__tu" in node:
            return tuple(_join(v, tensors) for v in node["__tu"])
    return node


def _replicated_state(train: TrainState) -> dict[str, Any]:
    """The state every rank of a replica group shares, as torch's distributed state-dict
    API gives it: FSDP2 parameters and their optimizer state as DTensors, FQN keys."""
    return {
        "model": get_model_state_dict(train.model),
        "optim": get_optimizer_state_dict(train.model, train.optimizer),
        "sched": train.scheduler.state_dict() if train.scheduler is not None else None,
        "scaler": train.scaler.state_dict() if train.scaler is not None else None,
    }


def _stage(t: torch.Tensor) -> torch.Tensor:
    """A host copy the next optimizer step cannot change. A DTensor stays a DTensor (DCP
    needs its placement to reshard); DTensor.from_local would move the copy back to the
    mesh's device, so the copy is wrapped with the original's spec (torch_private)."""
    if isinstance(t, DTensor):
        return dtensor_like(t, t.to_local().detach().to("cpu", copy=True))
    return t.detach().to("cpu", copy=True)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _pack_aux(aux: dict[str, Any]) -> torch.Tensor:
    skel, buf = flatten(_to_cpu(aux))
    n = torch.tensor([len(skel)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([n, _bytes_tensor(skel), buf])


def _unpack_aux(packed: torch.Tensor) -> dict[str, Any]:
    n = int(packed[:_LEN_BYTES].clone().view(torch.int64).item())
    skel = packed[_LEN_BYTES : _LEN_BYTES + n].numpy().tobytes()
    out: dict[str, Any] = unflatten(skel, packed[_LEN_BYTES + n :])
    return out


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


@dataclass
class DiskStats:
    """Timings of this rank's saves. *_s: seconds."""

    started: int = 0
    complete: int = 0  # saves rank 0 marked COMPLETE (every rank counts alike)
    failed: int = 0
    abandoned: int = 0  # saves a recovery cut short (not failures: the next cadence saves again)
    last_step: int | None = None  # the newest save that finished without error
    last_error: str | None = None
    last_stage_s: float = 0.0  # on the training thread: state dicts + host copies
    last_write_s: float = 0.0  # in the background: dcp.save (collectives, files, fsync) + COMPLETE
    last_wait_s: float = 0.0  # on the training thread: waiting for the previous save to finish
    total_wait_s: float = 0.0
    last_bytes: int = 0  # bytes this rank staged


class DiskCheckpointer:
    """Asynchronous DCP checkpoints in `directory`, one save in flight at most.

    Every method that touches the group (`save`, `load`) is collective: every rank
    calls it, for the same step. `group` must be a process group nothing else uses
    (e.g. `dist.new_group(backend="gloo")`, or a resild StableGroup of its own, then
    pass its `intr` so a save whose collectives were interrupted is never marked
    complete). `every` <= 0 turns periodic saves off (`due` is never true).
    """

    def __init__(
        self,
        directory: Path,
        every: int,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup,
        *,
        keep: int | None = None,
        intr: Interrupts | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.every, self.rank, self.world_size, self.group = every, rank, world_size, group
        self.keep = keep  # rank 0 prunes to `keep` after each complete save (None: only prune() does)
        self.intr = intr
        self.stats = DiskStats()
        self._thread: threading.Thread | None = None
        self._inflight: int | None = None
        self._abandoned = threading.Event()
        self.faults = faults  # tests and drills: a storage writer that fails, hangs or is slow
        self._lock = threading.Lock()
        self._outcomes: list[Outcome] = []  # finished saves, for the owner to report (take_outcomes)

    # ---- when --------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    @property
    def inflight(self) -> int | None:
        """The step of the save in flight, if any."""
        return self._inflight

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abandoned(self) -> bool:
        """The save in flight (if any) was abandoned by a recovery."""
        return self.busy() and self._abandoned.is_set()

    def broken(self) -> bool:
        """The group latched an error with no save of ours in flight: a collective failed
        outside a recovery, and nothing can use the group until a recovery forms it again."""
        return self.intr is not None and self.intr.error is not None and not self.busy()

    def take_outcomes(self) -> list[Outcome]:
        """Saves finished since the last call (the training thread reports them)."""
        with self._lock:
            out, self._outcomes = self._outcomes, []
        return out

    def wait(self, timeout_s: float | None) -> bool:
        """Block until no save is in flight (or `timeout_s`); True if none is."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
        return not self.busy()

    def abandon(self) -> None:
        """The save in flight belongs to a failed epoch: whatever its collectives return,
        do not mark it complete. Its thread ends when the group's collectives do."""
        if self.busy():
            self._abandoned.set()

    # ---- saving ------------------------------------------------------------------------
    def save(self, step: int, train: TrainState, aux: dict[str, Any]) -> None:
        """Stage `train`'s state and this rank's `aux` as of committed `step`, then write
        them in the background. Waits first for the previous save (stats.last_wait_s): a
        job under resild calls it only when the vote said no rank is writing, so never."""
        t0 = time.monotonic()
        self.wait(None)
        t1 = time.monotonic()
        self.stats.last_wait_s = t1 - t0
        self.stats.total_wait_s += t1 - t0
        if self.stats.last_wait_s > 0.01:
            log.info("disk checkpoint: step %d waited %.3fs for the previous save", step, self.stats.last_wait_s)
        flat = self._stage_all(step, train, aux)
        self.stats.last_stage_s = time.monotonic() - t1
        self.stats.last_bytes = sum(_local_nbytes(t) for t in flat.values())
        path = step_dir(self.directory, step)
        self._abandoned.clear()
        self._inflight = step
        self.stats.started += 1
        gen = self.intr.gen if self.intr is not None else 0
        self._thread = threading.Thread(
            target=self._write, args=(step, path, flat, gen), name="resild-checkpoint", daemon=True
        )
        self._thread.start()

    def _stage_all(self, step: int, train: TrainState, aux: dict[str, Any]) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        skel = _split(_replicated_state(train), "", tensors)
        flat = {k: _stage(v) for k, v in tensors.items()}
        if self.rank == 0:
            doc = {"format": FORMAT, "step": step, "world_size": self.world_size, "state": skel}
            flat[_SKELETON_KEY] = _bytes_tensor(json.dumps(doc, separators=(",", ":")).encode())
        flat[f"aux/rank{self.rank}"] = _pack_aux(aux)
        return flat

    def _writer(self, step: int, path: Path, gen: int) -> _Writer:
        faults = self.faults
        if faults is None:
            return _Writer(path)
        return _Writer(path, lambda point: faults.hit(point, step, lambda: self._reformed(gen)))

    def _reformed(self, gen: int) -> bool:
        """A recovery has formed the group again since generation `gen` (fault injection)."""
        return self.intr is not None and self.intr.gen != gen

    def _write(self, step: int, path: Path, flat: dict[str, torch.Tensor], gen: int) -> None:
        t0 = time.monotonic()
        if self.intr is not None:
            self.intr.pin(gen)  # this thread's collectives belong to this epoch only
        try:
            try:
                # 0700 before DCP writes into it (its files are 0644 by umask): the state, and
                # the metadata torch unpickles at a load, are no other user's to read or replace
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                dcp.save(flat, storage_writer=self._writer(step, path, gen), process_group=self.group)
            except CheckpointException as e:
                raise _dcp_error(e) from None
            # dcp.save returned: on rank 0 after every rank's files were written and
            # gathered, and the metadata; on every rank it returned or raised alike.
            marked = self._mark_complete(step, path, gen) if self.rank == 0 else False
            if not self._confirm(marked, gen):
                raise RuntimeError("rank 0 did not mark it complete (abandoned, or COMPLETE not written)")
            if self.rank == 0 and self.keep is not None:
                prune_dir(self.directory, self.keep)
            self.stats.complete += 1
            self.stats.last_step = step
            self.stats.last_error = None
            self._finished(Outcome(step, "saved", time.monotonic() - t0, nbytes=self.stats.last_bytes))
        except Exception as e:  # a failed save is lost, never fatal: training goes on
            error = f"{type(e).__name__}: {e}"[:500]
            if self._cut_short(gen):  # a recovery cut it short: whatever it raised is garbage
                self.stats.abandoned += 1
                log.info("disk checkpoint of step %d abandoned by a recovery (%s)", step, error)
                self._finished(Outcome(step, "abandoned", time.monotonic() - t0, error))
            else:
                self.stats.failed += 1
                self.stats.last_error = f"step {step}: {error}"
                log.warning("disk checkpoint of step %d failed: %s", step, error)
                self._finished(Outcome(step, "failed", time.monotonic() - t0, error))
        finally:
            self.stats.last_write_s = time.monotonic() - t0
            self._inflight = None
            if self.intr is not None:
                self.intr.pin(None)

    def _finished(self, outcome: Outcome) -> None:
        with self._lock:
            self._outcomes.append(outcome)

    def _mark_complete(self, step: int, path: Path, gen: int) -> bool:
        if not self._still_valid(gen):
            return False
        try:
            if self.faults is not None:
                self.faults.hit("complete", step, lambda: self._reformed(gen))
            marker = {"step": step, "world_size": self.world_size, "format": FORMAT, "t_wall": time.time()}
            _write_atomic(path / COMPLETE, json.dumps(marker).encode())
            return True
        except OSError as e:
            log.warning("disk checkpoint of step %d: COMPLETE not written: %s", step, e)
            return False

    def _confirm(self, marked: bool, gen: int) -> bool:
        """Rank 0 tells every rank whether it wrote COMPLETE, so that on every rank
        `wait()` returning means the step is decided (and loadable if complete)."""
        t = torch.tensor([1 if marked else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(int(t.item())) and self._still_valid(gen)  # an interrupted all-reduce reads garbage

    def _cut_short(self, gen: int) -> bool:
        """A recovery abandoned this save (not a failure of its own collectives)."""
        return self._abandoned.is_set() or (self.intr is not None and self.intr.gen != gen)

    def _still_valid(self, gen: int) -> bool:
        # Interrupts.fail latches the error before it releases the collectives it cuts
        # short, and a new epoch bumps gen: either shows a save built on garbage.
        if self._abandoned.is_set():
            return False
        return self.intr is None or (self.intr.error is None and self.intr.gen == gen)

    # ---- finding and loading -------------------------------------------------------------
    def newest_complete(self) -> int | None:
        """The highest step with a complete checkpoint (a pure read of the directory).
        Ranks reading a shared file system may disagree; `load` checks they do not."""
        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def load(self, step: int, train: TrainState) -> dict[str, Any]:
        """Collective over `group`: restore model, optimizer, scheduler and scaler of
        checkpoint `step` into `train`'s live objects (DCP reshards DTensors as needed)
        and return this rank's aux as saved (apply it with `train.rewind_aux`). A rank
        the checkpoint has no aux for (the world grew) gets {}: its RNG and data position
        start afresh. Waits for a save in flight first, unless a recovery abandoned it: its
        directory has no COMPLETE (so is never the one loaded) and its collectives no
        longer reach the group (pinned to its epoch), and its file system may be hung."""
        if not self._abandoned.is_set():
            self.wait(None)
        path = step_dir(self.directory, step)
        self._agree_on(step, _is_complete(path, step))
        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata().state_dict_metadata
        live: dict[str, torch.Tensor] = {}
        _split(_replicated_state(train), "", live)
        missing = sorted(set(live) - set(metadata))
        if missing:
            raise ValueError(f"checkpoint of step {step} does not match this model: no {missing[:5]}")
        aux_key = f"aux/rank{self.rank}"
        wanted = [k for k in metadata if not k.startswith("aux/") or k == aux_key]
        dest = {k: live[k] if k in live else _empty_like_saved(k, metadata[k]) for k in wanted}
        # Per-rank keys differ across ranks; DCP's load collectives (the plan and the
        # read results) do not depend on the keys, each rank reads only what it asks for.
        try:
            dcp.load(dest, storage_reader=reader, process_group=self.group)
        except CheckpointException as e:
            raise _dcp_error(e) from None
        doc = json.loads(dest[_SKELETON_KEY].numpy().tobytes())
        if doc.get("format") != FORMAT or doc.get("step") != step:
            raise ValueError(f"checkpoint of step {step}: unexpected skeleton (format {doc.get('format')})")
        self._restore(train, _join(doc["state"], dest))
        return _unpack_aux(dest[aux_key]) if aux_key in dest else {}

    def _agree_on(self, step: int, complete: bool) -> None:
        """Every rank must load the same, complete step (a stale directory listing on one
        node would otherwise mix two checkpoints, or leave the others in a collective
        alone): one small all-reduce on the group, and every rank raises alike."""
        t = torch.tensor([step, -step, 0 if complete else 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) != step or int(t[1]) != -step:
            raise ValueError(f"ranks disagree on the checkpoint to load: steps {-int(t[1])}..{int(t[0])}")
        if int(t[2]):
            raise FileNotFoundError(f"checkpoint of step {step} in {self.directory} is not complete on every rank")

    def _restore(self, train: TrainState, state: dict[str, Any]) -> None:
        set_model_state_dict(train.model, state["model"])
        set_optimizer_state_dict(train.model, train.optimizer, state["optim"])
        if train.scheduler is not None and state["sched"] is not None:
            train.scheduler.load_state_dict(state["sched"])
        if train.scaler is not None and state["scaler"] is not None:
            train.scaler.load_state_dict(state["scaler"])

    # ---- housekeeping ----------------------------------------------------------------------
    def prune(self, keep: int = 2) -> None:
        """Rank 0 deletes complete checkpoints beyond the newest `keep`, and partial ones
        older than the newest complete one; never the save in flight."""
        if self.rank == 0:
            prune_dir(self.directory, keep, protect=self._inflight)


class _Writer(dcp.FileSystemWriter):
    """DCP's file system writer, one file per rank, fsynced. Rank 0 (DCP's coordinator)
    removes an old COMPLETE of the same step (saved again after a rollback, or by an
    earlier run) in the global planning: no rank writes before that plan is scattered, and
    a failure there is DCP's, reported on every rank (on the training thread, a hung file
    system would stall training, and a failure leave the other ranks' saves unmatched).
    `hit(point)`: fault injection at plan, write, finish (checkpoint_faults)."""

    def __init__(self, path: Path, hit: Callable[[str], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._dir, self._hit = Path(path), hit

    def prepare_local_plan(self, plan: Any) -> Any:
        if self._hit is not None:
            self._hit("plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: Any) -> Any:
        marker = self._dir / COMPLETE
        if marker.exists():
            marker.unlink()
            _fsync_dir(self._dir)
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self._hit is not None:
            self._hit("write")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        if self._hit is not None:
            self._hit("finish")
        super().finish(metadata, results)


@dataclass(frozen=True)
class Outcome:
    """How one save ended on this rank. `result`: saved | failed | abandoned."""

    step: int
    result: str
    seconds: float
    error: str | None = None
    nbytes: int = 0


def _empty_like_saved(key: str, md: Any) -> torch.Tensor:
    """Room for a saved tensor the live state has no counterpart of (the skeleton, aux)."""
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"checkpoint entry {key!r} is not a tensor")
    return torch.empty(md.size, dtype=md.properties.dtype)


def _local_nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())
