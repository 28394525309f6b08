"""Plain FSDP2 (ZeRO-3: every rank holds a shard of its own, no second copy) under resild.

    resil-run --local --nodes 3 --spares 1 --nproc-per-node 2 -- \\
        python examples/train_fsdp.py --steps 60 --save final.pt

An ordinary FSDP2 loop (fully_shard over every rank, AdamW, gradient clipping,
a stateful data loader); the lines marked `# resild` are the only changes. No
rank holds another's shard, so a node loss is recovered by rollback: after
each commit every rank's shards, optimizer state, RNG, scheduler and loader
position are copied into the memory of `--snapshot-copies` other nodes; the
spare receives the lost ranks' newest complete snapshot from them, the
survivors restore their own copy of the same step, and training goes on.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--save", help="rank 0 writes the full, unsharded model and optimizer state here")
    p.add_argument("--compile", action="store_true", help="torch.compile each Linear (a spare compiles while it waits)")
    args = p.parse_args()
    torch.set_num_threads(1)

    def prepare(mesh: Any) -> None:  # resild: a waiting spare compiles the model before it is needed
        model = shard_model(build_model(args.seed, args.dropout), mesh, compile=True)
        x = torch.zeros(16, 128)
        F.mse_loss(model(x), x).backward()

    job = launcher.init(prepare=prepare if args.compile else None)  # resild: a spare waits here
    mesh = job.mesh((job.world_size,), ("shard",))  # resild: DeviceMesh over resild's groups

    model = shard_model(build_model(args.seed, args.dropout), mesh, args.compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ds = dataset(args.seed)
    sampler = DistributedSampler(ds, num_replicas=job.world_size, rank=job.rank, shuffle=True, seed=args.seed)
    loader = ResumableLoader(StatefulDataLoader(ds, batch_size=16, sampler=sampler))
    job.attach(model, opt, scheduler=sched, extra=loader)  # resild: state to protect and replay

    for step in job.steps(args.steps):  # resild: resumes at the committed step
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # FSDP2 reduce-scatters here
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
