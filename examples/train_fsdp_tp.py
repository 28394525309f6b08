"""FSDP2 on one mesh dimension, tensor parallelism on the other, under resild.

    resil-run --local --nodes 3 --spares 1 --nproc-per-node 2 -- \\
        python examples/train_fsdp_tp.py --steps 60 --save final.pt

A 2-D mesh ("shard", "tp"): the two ranks of a node split every MLP block's
matrices between them (ColwiseParallel up-projection, RowwiseParallel
down-projection), and FSDP2 shards the result across nodes. No rank holds a
copy of another's state: a node loss is recovered by rolling back to the
newest peer-memory snapshot (see examples/train_fsdp.py). The lines marked
`# resild` are the only changes to an ordinary FSDP2 + TP loop.
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import launcher  # resild
from launcher.worker.data import ResumableLoader  # resild: a data cursor it can rewind and replay

warnings.filterwarnings("ignore", message=".*set_vital.*")
DIM, HIDDEN = 128, 512


class Block(torch.nn.Module):
    """A transformer MLP block: pre-norm, up-projection, GELU, dropout, down-projection."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, DIM)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class Model(torch.nn.Module):
    def __init__(self, seed: int, dropout: float, depth: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every rank builds the same initial model
        self.blocks = torch.nn.ModuleList(Block(dropout) for _ in range(depth))
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for parameters on two meshes (TP-split blocks on ("shard", "tp"),
    the rest on ("shard",)): each mesh's norm in one reduction, then combined."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = min(1.0, max_norm / (float(total) + 1e-6))
    for grads in by_mesh.values():
        torch._foreach_mul_(grads, scale)
    return total


def dataset(seed: int, n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return TensorDataset(x, torch.tanh(x.roll(3, dims=1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (ranks per TP group)")
    p.add_argument("--save", help="rank 0 writes the full, unsharded model and optimizer state here")
    args = p.parse_args()
    torch.set_num_threads(1)

    job = launcher.init()  # resild: a spare waits here
    mesh = job.mesh((-1, args.tp), ("shard", "tp"))  # resild: DeviceMesh over resild's groups

    model = Model(args.seed, args.dropout)
    for b in model.blocks:
        # src_data_rank=None: each rank cuts its slice from its own copy (seeded alike) instead of
        # receiving it from rank 0; a spare joins a running job, so nothing communicates before attach.
        tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        parallelize_module(b, mesh["tp"], tp_plan, src_data_rank=None)
        fully_shard(b, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ds = dataset(args.seed)
    dp = mesh["shard"]  # ranks of a TP group read the same batch
    sampler = DistributedSampler(ds, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True, seed=args.seed)
    loader = ResumableLoader(StatefulDataLoader(ds, batch_size=16, sampler=sampler))
    job.attach(model, opt, scheduler=sched, extra=loader)  # resild: state to protect and replay

    for step in job.steps(args.steps):  # resild: resumes at the committed step
        x, y = next(loader)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        clip_grad_norm(list(model.parameters()), 1.0)
        job.commit()  # resild: vote, optimizer + scheduler step

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)  # collectives: every rank takes part
    osd = get_optimizer_state_dict(model, opt, options=options)
    if args.save and job.rank == 0:
        torch.save({"model": msd, "optimizer": osd, "step": job.step, "loader": loader.state_dict()}, args.save)
    job.close()  # resild


if __name__ == "__main__":
    main()
