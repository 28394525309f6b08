"""FSDP2 with HSDP (shard inside groups of ranks, replicate across them) under resild.

    resil-run --local --nodes 5 --spares 1 --nproc-per-node 2 -- \\
        python examples/train_hsdp.py --steps 60 --save final.pt

An ordinary FSDP2 loop (fully_shard over a 2-D DeviceMesh, AdamW, gradient
clipping, a stateful data loader); the lines marked `# resild` are the only
changes. A node loss is recovered in-process: the spare receives, for each of
its ranks, that rank's shards from the rank holding the same shard in the other
replica group, plus RNG, step, scheduler and the data loader's position.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import launcher  # resild
from launcher.worker.data import ResumableLoader  # resild: a data cursor it can rewind and replay

warnings.filterwarnings("ignore", message=".*set_vital.*")


def build_model(seed: int, dropout: float) -> torch.nn.Module:
    torch.manual_seed(seed)  # every rank builds the same initial model, as FSDP2 expects
    return torch.nn.Sequential(
        torch.nn.Linear(128, 512),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(512, 512),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(512, 128),
    )


def shard_model(model: torch.nn.Sequential, mesh: Any, compile: bool) -> torch.nn.Sequential:
    """FSDP2 over every Linear and the whole; `compile`: each Linear under torch.compile first
    (compiled code computes on the gathered parameters, FSDP2's hooks stay eager)."""
    for i, layer in enumerate(model):
        if isinstance(layer, torch.nn.Linear):
            if compile:
                model[i] = layer = torch.compile(layer)  # type: ignore[assignment]
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def dataset(seed: int, n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    return TensorDataset(x, torch.tanh(x.roll(3, dims=1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--shard-size", type=int, default=0, help="ranks per shard group (default: world size / 2)")
    p.add_argument("--save", help="rank 0 writes the full, unsharded model and optimizer state here")
    p.add_argument("--compile", action="store_true", help="torch.compile each Linear (a spare compiles while it waits)")
    args = p.parse_args()
    torch.set_num_threads(1)

    def prepare(mesh: Any) -> None:  # resild: a waiting spare compiles the model before it is needed
        model = shard_model(build_model(args.seed, args.dropout), mesh, compile=True)
        x = torch.zeros(16, 128)
        F.mse_loss(model(x), x).backward()

    job = launcher.init(prepare=prepare if args.compile else None)  # resild: a spare waits here
    shard = args.shard_size or max(1, job.world_size // 2)
    mesh = job.hsdp_mesh(shard_size=shard)  # resild: DeviceMesh over resild's groups

    model = shard_model(build_model(args.seed, args.dropout), mesh, args.compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ds = dataset(args.seed)
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=args.seed)
    loader = ResumableLoader(StatefulDataLoader(ds, batch_size=16, sampler=sampler))
    job.attach(model, opt, scheduler=sched, extra=loader)  # resild: state to protect and replay

    def follow(old: int, new: int) -> None:  # resild (--min-replicas): the job shrank or grew
        # the sampler splits the data over the new width from the loader's next pass on
        sampler.num_replicas, sampler.rank = job.world_size, job.rank
        sampler.num_samples = math.ceil(len(ds) / job.world_size)
        sampler.total_size = sampler.num_samples * job.world_size
        print(f"rank {job.rank}: {old} -> {new} ranks, {job.replicas} replicas", file=sys.stderr)

    job.on_resize(follow)

    for step in job.steps(args.steps):  # resild: resumes at the committed step
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # FSDP2 reduce-scatters + all-reduces here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        job.commit()  # resild: vote, optimizer + scheduler step

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)  # collectives: every rank takes part
    osd = get_optimizer_state_dict(model, opt, options=options)
    if args.save and job.rank == 0:
        torch.save({"model": msd, "optimizer": osd, "step": job.step, "loader": loader.state_dict()}, args.save)
    job.close()  # resild


if __name__ == "__main__":
    main()
