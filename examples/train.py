"""A plain data-parallel training loop made resilient by resild.

Run it under the embedded local cluster:

    resil-run --local --nodes 3 --spares 1 --nproc-per-node 2 -- python examples/train.py --steps 300

The lines marked `# resild` are the only changes from an ordinary loop.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import launcher  # resild


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # ~1M parameters: big enough that state replay moves real bytes.
    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 256),
    )


def make_batch(seed: int, step: int, rank: int, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: the data position is the step number."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(batch, 256, generator=g)
    return x, torch.tanh(x.roll(1, dims=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write the final model and optimizer state here (rank 0)")
    p.add_argument(
        "--keep-global-batch",
        action="store_true",
        help="under resil-run --min-replicas: when the job shrinks, accumulate the missing ranks' batches",
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    model = build_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)

    job = launcher.init(model, opt, scheduler=sched)  # resild: a spare waits here, warm
    job.on_resize(lambda old, new: print(f"rank {job.rank}: {old} -> {new} ranks", file=sys.stderr))  # resild
    for step in job.steps(args.steps):  # resild: resumes at the committed step
        opt.zero_grad()
        if args.keep_global_batch:  # resild: the batches of every rank of the full width
            for shard in job.data_shards():
                x, y = make_batch(args.seed, step, shard)
                (F.mse_loss(model(x), y) * job.shard_weight).backward()
        else:  # the per-rank batch: a job that shrank trains on a smaller global batch
            x, y = make_batch(args.seed, step, job.rank)
            F.mse_loss(model(x), y).backward()
        job.commit()  # resild: all-reduce, vote, optimizer+scheduler step
    if args.save and job.rank == 0:  # resild
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": job.step}, args.save)
    job.close()  # resild


if __name__ == "__main__":
    main()
