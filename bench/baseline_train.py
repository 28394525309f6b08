"""Baseline worker: plain DDP training with a disk checkpoint, run under torchrun.

This is what people use today: `torchrun --max-restarts N` restarts every worker
after any failure, and each fresh process re-imports torch, re-forms the gloo group,
rebuilds the model and optimizer, and resumes from the newest disk checkpoint.

Same model and data as ``examples/train.py`` (``build_model``, ``make_batch``), Adam
lr 1e-3 + StepLR(100, 0.5), one intra-op thread, gloo, gradients averaged by
DistributedDataParallel (``--grad-sync ddp``, the default) or by one flat manual
all-reduce (``--grad-sync allreduce``).

Step numbering: step k is the (k+1)-th optimizer step, k = 0 .. steps-1. A checkpoint
written after step k holds ``"step": k + 1`` (the number of steps it contains, which is
also the next step to run); it is written by rank 0 whenever (k + 1) % ckpt_every == 0.
The fault is injected at the top of step ``--kill-at`` (before its forward pass), so
exactly ``kill_at`` steps were committed when the rank dies.

Events, one JSON line each, appended to ``--events`` with a single ``os.write`` (so
lines from several processes never interleave). Every event carries ``event``,
``rank``, ``pid``, ``t_wall`` (time.time(), comparable across processes) and
``restart_count`` (TORCHELASTIC_RESTART_COUNT):

- ``start``          first thing the process does, before importing torch
- ``ready``          group formed, model/optimizer/scheduler built, checkpoint loaded;
                     carries ``resumed_step`` and wall times of the sub-phases
                     (``t_torch_imported``, ``t_group_ready``, ``t_model_built``,
                     ``t_ckpt_loaded``, ``t_wrapped``)
- ``step``           after each optimizer step (``step``; rank 0 adds ``loss``)
- ``ckpt``           rank 0, after a checkpoint is on disk (``step``, ``save_s``)
- ``fault_injected`` just before the rank SIGKILLs itself (first attempt only)
- ``done``           after the last step
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_T_START = time.time()
RESTART_COUNT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def _events_path(argv: list[str]) -> str | None:
    # Parsed by hand so the start event is written before argparse/torch are imported.
    for i, a in enumerate(argv):
        if a == "--events" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--events="):
            return a.split("=", 1)[1]
    return None


_EVENTS_FD: int | None = None


def emit(event: str, **fields: Any) -> None:
    """Append one JSON line; one write() per line, O_APPEND, unbuffered."""
    if _EVENTS_FD is None:
        return
    rec = {
        "event": event,
        "rank": RANK,
        "pid": os.getpid(),
        "restart_count": RESTART_COUNT,
        "t_wall": fields.pop("t_wall", None) or time.time(),
    }
    rec.update(fields)
    os.write(_EVENTS_FD, (json.dumps(rec) + "\n").encode())


_ep = _events_path(sys.argv[1:])
if _ep:
    _EVENTS_FD = os.open(_ep, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
emit("start", t_wall=_T_START)

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import signal  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_T_TORCH = time.time()

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)
from examples.train import build_model, make_batch  # noqa: E402


def _grad(q: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient: every parameter takes part in the loss, so it has one after backward."""
    assert q.grad is not None
    return q.grad


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step}, tmp
    )
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", required=True, help="checkpoint file (resumed from if present)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--kill-at", type=int, default=-1, help="step at which to SIGKILL (first attempt only); <0: never")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--events", help="JSONL event file (append)")
    p.add_argument("--grad-sync", choices=("ddp", "allreduce"), default="ddp")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective/init timeout, seconds")
    args = p.parse_args()

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: where is it stuck?
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    t_group = time.time()

    model = build_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    t_built = time.time()

    start_step = 0
    if os.path.exists(args.ckpt):
        ck = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        start_step = int(ck["step"])
    t_loaded = time.time()

    if args.grad_sync == "ddp":
        # The constructor broadcasts rank 0's parameters: also the barrier that keeps
        # rank 0 from overwriting the checkpoint before every rank has read it.
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = model
        dist.barrier()
    t_wrapped = time.time()
    emit(
        "ready",
        resumed_step=start_step,
        world_size=world,
        grad_sync=args.grad_sync,
        t_torch_imported=_T_TORCH,
        t_group_ready=t_group,
        t_model_built=t_built,
        t_ckpt_loaded=t_loaded,
        t_wrapped=t_wrapped,
    )

    params = [q for q in model.parameters()]
    for step in range(start_step, args.steps):
        if step == args.kill_at and RESTART_COUNT == 0 and rank == args.kill_rank:
            emit("fault_injected", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = make_batch(args.seed, step, rank)
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # untyped in torch
        if args.grad_sync == "allreduce":
            flat = torch.cat([_grad(q).reshape(-1) for q in params])
            dist.all_reduce(flat)
            flat.div_(world)
            off = 0
            for q in params:
                n = q.numel()
                _grad(q).copy_(flat[off : off + n].view_as(q))
                off += n
        opt.step()
        sched.step()
        if rank == 0:
            emit("step", step=step, loss=loss.item())
        else:
            emit("step", step=step)
        if rank == 0 and (step + 1) % args.ckpt_every == 0:
            t0 = time.time()
            save_checkpoint(args.ckpt, model, opt, sched, step + 1)
            emit("ckpt", step=step + 1, save_s=time.time() - t0)

    emit("done", steps=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
