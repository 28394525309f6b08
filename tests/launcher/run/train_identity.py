"""examples/train_fsdp_tp.py with the clipping a script may write by hand: gradients grouped
by mesh *object* (`id(grad.device_mesh)`), one norm collective per group. FSDP2 makes one
mesh object per tensor-parallel parameter, so the loop issues as many collectives as the
process has such objects: a spare whose objects differ from a fresh process's issues a
different number, and its peers' collectives no longer match. At the end every rank writes
what it can reach (tests/launcher/structure.py) next to --save, for the test to compare
with a failure-free run's, rank by rank."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO), str(REPO / "examples")]
from train_fsdp import build_model, shard_model  # noqa: E402
from train_fsdp_tp import Model, dataset  # noqa: E402

import launcher  # noqa: E402
from tests.launcher.structure import structure  # noqa: E402

warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message=".*sequential all_reduce.*")


def clip_by_object(params: list[torch.nn.Parameter], max_norm: float, skip_last: bool = False) -> None:
    by_object: dict[int, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_object.setdefault(id(p.grad.device_mesh), []).append(p.grad)
    norms = []
    groups = list(by_object.values())
    for grads in groups[:-1] if skip_last else groups:
        n = torch.nn.utils.get_total_norm(grads)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)  # a collective per object
    total = torch.linalg.vector_norm(torch.stack(norms))
    for grads in by_object.values():
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--save")
    p.add_argument(
        "--kind",
        choices=("tp", "hsdp", "fsdp"),
        default="tp",
        help="tp: FSDP2 x TP on ('shard', 'tp'); hsdp: examples/train_hsdp.py's model on job.hsdp_mesh; "
        "fsdp: examples/train_fsdp.py's on ('shard',)",
    )
    p.add_argument(
        "--diverge-on-spare",
        action="store_true",
        help="a program error: a process that joined late skips its last norm collective",
    )
    p.add_argument(
        "--abort-on-spare",
        action="store_true",
        help="every step ends with a world all-gather of 2 elements; a process that joined late sends 3 from its "
        "second step on (gloo aborts a peer: the first step after a recovery is checked, the next is not)",
    )
    p.add_argument("--hold-at", type=int, help="every rank waits at the top of this step until --gate exists")
    p.add_argument("--gate", help="the file --hold-at waits for (the test creates it)")
    args = p.parse_args()
    torch.set_num_threads(1)
    job = launcher.init()
    late = job.epoch > 1  # a spare given ranks
    model: torch.nn.Module
    if args.kind == "tp":
        mesh = job.mesh((-1, 2), ("shard", "tp"))
        model = Model(0, 0.1)
        for b in model.blocks:
            tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            parallelize_module(b, mesh["tp"], tp_plan, src_data_rank=None)
            fully_shard(b, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        data = (mesh["shard"].get_local_rank(), mesh["shard"].size())  # a TP group reads one batch
    else:
        mesh = job.hsdp_mesh(job.world_size // 2) if args.kind == "hsdp" else job.mesh((-1,), ("shard",))
        model = shard_model(build_model(0, 0.1), mesh, compile=False)  # type: ignore[arg-type]
        data = (job.rank, job.world_size)  # every rank its own batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ds = dataset(0)
    job.attach(model, opt)
    taken_over_steps = 0
    for step in job.steps(args.steps):
        while step == args.hold_at and args.gate and not os.path.exists(args.gate):
            time.sleep(0.05)  # held by the test (it loses a node meanwhile)
        i = (step * data[1] + data[0]) * 16 % len(ds)
        x, y = ds[i : i + 16]
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        clip_by_object(list(model.parameters()), 1.0, skip_last=args.diverge_on_spare and late)
        if args.abort_on_spare:
            n = 3 if late and taken_over_steps >= 1 else 2
            torch.distributed.all_gather_into_tensor(torch.zeros(n * job.world_size), torch.zeros(n))
            taken_over_steps += 1
        job.commit()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    msd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if args.save:
        out = Path(f"{args.save}.structure-rank{job.rank}.json")
        out.write_text(json.dumps(structure(model, opt)))
        if job.rank == 0:
            torch.save({"model": msd, "step": job.step}, args.save)
    job.close()


if __name__ == "__main__":
    main()
