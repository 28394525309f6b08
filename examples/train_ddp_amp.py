"""DistributedDataParallel with mixed precision (GradScaler), gradient accumulation
and clipping, under resild.

    resil-run --local --nodes 5 --spares 1 --nproc-per-node 2 -- \\
        python examples/train_ddp_amp.py --steps 60 --save final.pt

A standard DDP loop; the lines marked `# resild` are the only changes. DDP's
bucketed all-reduce runs during backward on resild's stable group; the
GradScaler's inf/NaN verdict is agreed by every rank in the commit vote, so all
ranks skip a step together or none does.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import launcher  # resild

MICRO_STEPS = 4


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(1024, 256),
    )


def make_batch(seed: int, step: int, micro: int, rank: int, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: the data position is (step, micro-step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + micro * 101 + rank)
    x = torch.randn(batch, 256, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the final model, optimizer and scaler state here (rank 0)")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = launcher.init()  # resild: a spare waits here
    model = DDP(
        build_model(args.seed),
        process_group=job.group,  # resild: the job's stable group
        init_sync=False,
    )  # resild: a spare joins a running job
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    job.attach(model, opt, scheduler=sched, scaler=scaler)  # resild: state to protect and replay
    # resild (--min-replicas): told when the job shrinks or grows; DDP follows on its own
    job.on_resize(lambda old, new: print(f"rank {job.rank}: {old} -> {new} ranks", file=sys.stderr))

    for step in job.steps(args.steps):  # resild: resumes at the committed step
        opt.zero_grad()
        for micro in range(MICRO_STEPS):
            x, y = make_batch(args.seed, step, micro, job.rank)
            last = micro == MICRO_STEPS - 1
            with model.no_sync() if not last else contextlib.nullcontext():  # all-reduce only on the last micro-step
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.mse_loss(model(x), y) / MICRO_STEPS
                scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        job.commit()  # resild: vote (incl. inf/NaN), scaler + optimizer + scheduler step

    if args.save and job.rank == 0:
        torch.save(
            {
                "model": model.module.state_dict(),
                "optimizer": opt.state_dict(),
                "scaler": scaler.state_dict(),
                "step": job.step,
            },
            args.save,
        )
    job.close()  # resild


if __name__ == "__main__":
    main()
