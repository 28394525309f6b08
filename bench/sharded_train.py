"""Worker of bench/sharded.py: one training loop, run under resild or under plain torchrun.

    # resild (examples/train_ddp_amp.py / examples/train_hsdp.py, as they are)
    resil-run --local --nodes 2 --spares 0 --nproc-per-node 2 -- \\
        python bench/sharded_train.py --mode resild --model hsdp --steps 200 --times t.json
    # the same loop without resild: torchrun, gloo, init_device_mesh, plain optimizer step
    torchrun --standalone --nproc-per-node 4 bench/sharded_train.py --mode plain --model hsdp --times t.json
    # a raw gloo send/recv of N bytes between two processes (the replay's yardstick)
    torchrun --standalone --nproc-per-node 2 bench/sharded_train.py --mode loopback --nbytes N --times t.json
    # plain FSDP2 (bench/snapshots.py): under resild, and under torchrun with a DCP checkpoint
    resil-run --local --nodes 4 --spares 0 --nproc-per-node 1 --snapshot-copies 1 -- \\
        python bench/sharded_train.py --mode resild --model fsdp --times t.json
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 4 --max-restarts 1 \\
        bench/sharded_train.py --mode plain --model fsdp --ckpt-dir ckpt --ckpt-every 50 \\
        --kill-at 60 --kill-rank 2 --events events.jsonl

Models, data and loops are those of the examples:

- ``--model ddp``: ``DistributedDataParallel`` (256-1024-256 MLP, dropout), AdamW, LinearLR,
  ``GradScaler`` with CPU autocast float16, 4 gradient-accumulation micro-steps (``no_sync``
  on the first three), ``clip_grad_norm_``.
- ``--model hsdp``: FSDP2 ``fully_shard`` per Linear and on the root over a 2-D mesh
  (replicate x shard, shard = world size / 2), AdamW, CosineAnnealingLR, clipping, a
  ``StatefulDataLoader`` over a ``DistributedSampler`` (``launcher.worker.data.ResumableLoader``, a
  plain data cursor with no resild runtime in it, in both modes).
- ``--model tp``: ``examples/train_fsdp_tp.py`` (FSDP2 on "shard" x tensor parallelism on
  "tp", 2 ranks per TP group): its model, clipping per mesh, data and loop; resild recovers
  it from peer-memory snapshots (no rank holds a replica).
- ``--model fsdp``: ``examples/train_fsdp.py`` (plain FSDP2, ZeRO-3): the hsdp model, data and
  loop over a 1-D mesh of every rank (``job.mesh((W,), ("shard",))`` /
  ``init_device_mesh("cpu", (W,), mesh_dim_names=("shard",))``); no rank holds a replica of
  another's shard. Rank 0's ``--times`` adds ``state_bytes``: its local model + optimizer
  tensor bytes (the shards of the parameters and of AdamW's state).
  Plain mode only, the torchrun baseline of a recovery (``bench/snapshots.py``):
  ``--ckpt-dir D`` loads the newest complete ``torch.distributed.checkpoint`` under D at
  start (``D/step-N``, N = the next step to run: model and optimizer shards, scheduler,
  each rank's loader position and RNG) and saves one every ``--ckpt-every`` steps;
  ``--kill-at K --kill-rank R``: rank R SIGKILLs itself at the top of step K in the first
  attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so K steps were committed; ``--events F``:
  every rank appends ``bench/baseline_train.py``'s events (``start``, ``ready``, ``step``,
  ``ckpt``, ``fault_injected``, ``done``) to F, which ``bench.torchrun_baseline.analyze`` reads.

The only differences between the modes are the resild lines: ``launcher.init()``, the job's
stable group / ``job.hsdp_mesh`` instead of ``init_process_group`` / ``init_device_mesh``,
``job.attach``, ``job.steps`` and ``job.commit()`` (vote, then the same
``scaler.step/update`` or ``opt.step`` and ``sched.step``) instead of calling them directly.

Rank 0 writes ``--times`` (JSON): per committed step ``[step, t_top, t_commit, t_end]``
(``time.perf_counter``: top of the step, just before the commit / optimizer step, after
it). ``t_end[k] - t_end[k-1]`` is step k's time; ``t_end - t_commit`` the commit part.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import launcher  # resild (imports nothing more until launcher.init)
from launcher.worker.data import ResumableLoader  # a data cursor only (torch + torchdata)

if TYPE_CHECKING:
    from launcher.worker.runtime import Job

# Everything is imported before launcher.init(), as in the examples: a spare taking
# over pays only for what follows init (mesh, model, fully_shard, optimizer, attach).
warnings.filterwarnings("ignore", message=".*set_vital.*")
_T_IMPORTED = time.time()  # fsdp --events: every import done (torch, torchdata, launcher)

MICRO_STEPS = 4  # examples/train_ddp_amp.py


# ---- models and data, as in the examples ------------------------------------------------
def ddp_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(1024, 256)
    )


def ddp_batch(seed: int, step: int, micro: int, rank: int, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro * 101 + rank)
    x = torch.randn(batch, 256, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def hsdp_model(seed: int, dropout: float = 0.1) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(512, 512),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(512, 128),
    )


def hsdp_loader(seed: int, world: int, rank: int, n: int = 4096) -> ResumableLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    ds = TensorDataset(x, torch.tanh(x.roll(3, dims=1)))
    sampler: DistributedSampler[tuple[torch.Tensor, ...]]
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    return ResumableLoader(StatefulDataLoader(ds, batch_size=16, sampler=sampler))


# ---- the two ways of running the same loop ----------------------------------------------
class Plain:
    """torchrun: gloo default group, plain optimizer step."""

    def __init__(self) -> None:
        dist.init_process_group("gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = None  # DDP's default: the world group
        # attach's: an optimizer, an LR scheduler, an AMP GradScaler (whichever the loop made)
        self.opt: Any = None
        self.sched: Any = None
        self.scaler: Any = None
        self.start = 0  # fsdp: the step a DCP checkpoint resumes at

    def mesh(self, shard: int) -> DeviceMesh:
        return init_device_mesh("cpu", (self.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))

    def mesh_1d(self) -> DeviceMesh:
        return init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("shard",))

    def mesh_tp(self, tp: int) -> DeviceMesh:
        return init_device_mesh("cpu", (self.world_size // tp, tp), mesh_dim_names=("shard", "tp"))

    def attach(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        extra: Any = None,
    ) -> None:
        self.opt, self.sched, self.scaler = opt, scheduler, scaler

    def steps(self, total: int) -> Iterator[int]:
        yield from range(self.start, total)

    def commit(self) -> bool:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.sched.step()
        return True

    def close(self) -> None:
        dist.destroy_process_group()


class Resild:
    def __init__(self) -> None:
        self.job: Job = launcher.init()  # a spare waits here
        self.rank, self.world_size, self.group = self.job.rank, self.job.world_size, self.job.group

    def mesh(self, shard: int) -> DeviceMesh:
        return cast(DeviceMesh, self.job.hsdp_mesh(shard_size=shard))

    def mesh_1d(self) -> DeviceMesh:
        return cast(DeviceMesh, self.job.mesh((self.world_size,), ("shard",)))

    def mesh_tp(self, tp: int) -> DeviceMesh:
        return cast(DeviceMesh, self.job.mesh((-1, tp), ("shard", "tp")))

    def attach(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        extra: Any = None,
    ) -> None:
        self.job.attach(model, opt, scheduler=scheduler, scaler=scaler, extra=extra)

    def steps(self, total: int) -> Iterator[int]:
        return self.job.steps(total)

    def commit(self) -> bool:
        return self.job.commit()

    def close(self) -> None:
        self.job.close()


# ---- the loops ------------------------------------------------------------------------
Runtime = Plain | Resild
Record = Callable[[int, float, float, float], None]  # (step, t_top, t_commit, t_end)
Mark = Callable[[str], None]


def train_ddp(rt: Runtime, args: argparse.Namespace, record: Record, mark: Mark) -> None:
    kw = {"process_group": rt.group, "init_sync": False} if rt.group is not None else {}
    model = DDP(ddp_model(args.seed), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    mark("built")
    rt.attach(model, opt, scheduler=sched, scaler=scaler)
    mark("attached")
    for step in rt.steps(args.steps):
        t_top = time.perf_counter()
        opt.zero_grad()
        for micro in range(MICRO_STEPS):
            x, y = ddp_batch(args.seed, step, micro, rt.rank)
            last = micro == MICRO_STEPS - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y) / MICRO_STEPS
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t_commit = time.perf_counter()
        if rt.commit():
            record(step, t_top, t_commit, time.perf_counter())


def train_hsdp(rt: Runtime, args: argparse.Namespace, record: Record, mark: Mark) -> None:
    shard = max(1, rt.world_size // 2)
    mesh = rt.mesh(shard)
    mark("mesh")
    model = hsdp_model(args.seed)
    mark("model")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mark("sharded")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = hsdp_loader(args.seed, rt.world_size, rt.rank)
    mark("built")
    rt.attach(model, opt, scheduler=sched, extra=loader)
    mark("attached")
    first = True
    for step in rt.steps(args.steps):
        t_top = time.perf_counter()
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        if first:
            mark("first_backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if first:
            mark("first_clip")
            first = False
        t_commit = time.perf_counter()
        if rt.commit():
            record(step, t_top, t_commit, time.perf_counter())


def train_tp(rt: Runtime, args: argparse.Namespace, record: Record, mark: Mark) -> None:
    """examples/train_fsdp_tp.py's loop (its model and per-mesh clipping, imported)."""
    import sys

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from train_fsdp_tp import Model, clip_grad_norm, dataset

    tp = 2
    mesh = rt.mesh_tp(tp)
    mark("mesh")
    model = Model(args.seed, 0.1)
    mark("model")
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
        fully_shard(b, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    mark("sharded")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ds, dp = dataset(args.seed), mesh["shard"]
    sampler: DistributedSampler[tuple[torch.Tensor, ...]]
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True, seed=args.seed)
    loader = ResumableLoader(StatefulDataLoader(ds, batch_size=16, sampler=sampler))
    mark("built")
    rt.attach(model, opt, scheduler=sched, extra=loader)
    mark("attached")
    first = True
    for step in rt.steps(args.steps):
        t_top = time.perf_counter()
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        if first:
            mark("first_backward")
        clip_grad_norm(list(model.parameters()), 1.0)
        if first:
            mark("first_clip")
            first = False
        t_commit = time.perf_counter()
        if rt.commit():
            record(step, t_top, t_commit, time.perf_counter())


def local_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """This rank's own tensor bytes: its parameter shards and its optimizer state's."""

    def nbytes(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    n = sum(nbytes(p.data) for p in model.parameters())
    return n + sum(nbytes(v) for st in opt.state.values() for v in st.values())


class Events:
    """``bench/baseline_train.py``'s event lines (one ``os.write`` each, O_APPEND)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.rank, self.restart_count = rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def __call__(self, event: str, **fields: Any) -> None:
        if self.fd is None:
            return
        rec = {"event": event, "rank": self.rank, "pid": os.getpid(), "restart_count": self.restart_count}
        rec["t_wall"] = fields.pop("t_wall", None) or time.time()
        rec.update(fields)
        os.write(self.fd, (json.dumps(rec) + "\n").encode())


def process_start_wall() -> float:
    """time.time() of this process's start (from /proc, 1 / CLK_TCK resolution)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _dcp_state(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    loader: ResumableLoader,
    rank: int,
) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    # keys of one rank only: DCP would keep one rank's copy of a key every rank saves
    own = {"loader": loader.state_dict(), "rng": torch.get_rng_state()}
    return {"model": msd, "optim": osd, "sched": sched.state_dict(), f"rank{rank}": own}


def newest_checkpoint(ckpt_dir: str) -> tuple[int, Path] | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last) under ``ckpt_dir``."""
    found = []
    for d in Path(ckpt_dir).glob("step-*"):
        if (d / ".metadata").exists():
            try:
                found.append((int(d.name.split("-", 1)[1]), d))
            except ValueError:
                continue
    return max(found) if found else None


def train_fsdp(rt: Runtime, args: argparse.Namespace, record: Record, mark: Mark) -> dict[str, Any]:
    """examples/train_fsdp.py's loop; plain mode may add a DCP checkpoint and a fault."""
    emit = Events(args.events, rt.rank)
    emit("start", t_wall=args.t_start)
    t_group = time.time()
    mesh = rt.mesh_1d()
    mark("mesh")
    model = hsdp_model(args.seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    loader = hsdp_loader(args.seed, rt.world_size, rt.rank)
    mark("built")
    t_built = time.time()
    start = 0
    if args.ckpt_dir and args.mode == "plain":
        newest = newest_checkpoint(args.ckpt_dir)
        if newest is not None:
            start, path = newest
            state = _dcp_state(model, opt, sched, loader, rt.rank)
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            sched.load_state_dict(state["sched"])
            own = state[f"rank{rt.rank}"]
            loader.load_state_dict(own["loader"])
            torch.set_rng_state(own["rng"])
        cast(Plain, rt).start = start  # plain mode: rt is Plain
    t_loaded = time.time()
    rt.attach(model, opt, scheduler=sched, extra=loader)
    mark("attached")
    emit(
        "ready",
        resumed_step=start,
        world_size=rt.world_size,
        t_torch_imported=_T_IMPORTED,
        t_group_ready=t_group,
        t_model_built=t_built,
        t_ckpt_loaded=t_loaded,
        t_wrapped=t_loaded,
    )
    for step in rt.steps(args.steps):
        if step == args.kill_at and emit.restart_count == 0 and rt.rank == args.kill_rank:
            emit("fault_injected", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        t_top = time.perf_counter()
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t_commit = time.perf_counter()
        if rt.commit():
            record(step, t_top, t_commit, time.perf_counter())
            emit("step", step=step)
            if args.ckpt_dir and args.mode == "plain" and (step + 1) % args.ckpt_every == 0:
                t0 = time.time()
                dcp.save(
                    _dcp_state(model, opt, sched, loader, rt.rank), checkpoint_id=f"{args.ckpt_dir}/step-{step + 1}"
                )
                if rt.rank == 0:
                    emit("ckpt", step=step + 1, save_s=time.time() - t0)
    emit("done", steps=args.steps)
    return {"state_bytes": local_state_bytes(model, opt)}


# ---- loopback yardstick ---------------------------------------------------------------
def loopback(args: argparse.Namespace) -> None:
    """Rank 1 sends a uint8 tensor of --nbytes to rank 0 (gloo, TCP over loopback),
    --iters times after one warm-up exchange; rank 0 times each recv (the sender
    starts after a barrier, so the recv's time is the transfer)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    buf = (
        torch.zeros(args.nbytes, dtype=torch.uint8)
        if rank == 0
        else torch.randint(0, 255, (args.nbytes,), dtype=torch.uint8)
    )
    seconds = []
    for i in range(args.iters + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.recv(buf, src=1)
        else:
            dist.send(buf, dst=0)
        dt = time.perf_counter() - t0
        if i > 0:
            seconds.append(dt)
    dist.barrier()
    if rank == 0 and args.times:
        with open(args.times, "w") as f:
            json.dump({"mode": "loopback", "nbytes": args.nbytes, "seconds": seconds}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("resild", "plain", "loopback"), required=True)
    p.add_argument("--model", choices=("ddp", "hsdp", "fsdp", "tp"), default="ddp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--times", help="rank 0 writes its per-step times here (JSON)")
    p.add_argument(
        "--phases",
        help="every rank writes DIR/phases-<pid>.json: time.monotonic() after init, "
        "mesh, model build, fully_shard, optimizer/loader, attach, the first step's backward, "
        "clipping and commit",
    )
    p.add_argument(
        "--prewarm",
        action="store_true",
        help="import torch._dynamo before launcher.init (fully_shard imports it on first use)",
    )
    p.add_argument("--nbytes", type=int, default=1 << 20, help="loopback: bytes per transfer")
    p.add_argument("--iters", type=int, default=20, help="loopback: timed transfers")
    p.add_argument("--ckpt-dir", help="fsdp, plain: DCP checkpoints here (the newest is loaded at start)")
    p.add_argument("--ckpt-every", type=int, default=50, help="fsdp, plain: steps between DCP checkpoints")
    p.add_argument("--kill-at", type=int, default=-1, help="fsdp: SIGKILL at the top of this step (1st attempt)")
    p.add_argument("--kill-rank", type=int, default=2, help="fsdp: the rank that SIGKILLs itself")
    p.add_argument("--events", help="fsdp: every rank appends bench/baseline_train.py's events here")
    args = p.parse_args()
    args.t_start = process_start_wall()
    torch.set_num_threads(1)
    if args.mode == "loopback":
        loopback(args)
        return

    marks: dict[str, float] = {"start": time.monotonic()}
    if args.prewarm:
        # fully_shard's first call imports torch._dynamo (~200 modules, 0.5-0.7 s here,
        # through torch._compile's lazy disable); a spare would pay it after taking over.
        importlib.import_module("torch._dynamo")
    rt = Resild() if args.mode == "resild" else Plain()
    marks["init"] = time.monotonic()
    rows: list[list[float]] = []

    def mark(name: str) -> None:
        marks[name] = time.monotonic()

    def record(step: int, t_top: float, t_commit: float, t_end: float) -> None:
        if not rows:
            mark("first_commit")
        rows.append([step, t_top, t_commit, t_end])

    loops = {"ddp": train_ddp, "hsdp": train_hsdp, "fsdp": train_fsdp, "tp": train_tp}
    extra = loops[args.model](rt, args, record, mark) or {}
    if args.phases:
        with open(os.path.join(args.phases, f"phases-{os.getpid()}.json"), "w") as f:
            json.dump({"rank": rt.rank, "pid": os.getpid(), "marks": marks}, f)
    if args.times and rt.rank == 0:
        tmp = f"{args.times}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"mode": args.mode, "model": args.model, "world_size": rt.world_size, "steps": rows, **extra}, f)
        os.replace(tmp, args.times)
    rt.close()


if __name__ == "__main__":
    main()
