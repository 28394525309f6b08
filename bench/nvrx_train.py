"""Worker for ``bench/peers_nvrx.py``: the ``examples/train.py`` job under NVIDIA's resiliency extension.

Runs in the NVRx venv (``.venv-nvrx``: torch 2.13 CPU + ``nvidia-resiliency-ext==0.4.1``), never
in resild's: nothing here imports resild. Same model, data and step as ``bench/peers_torchft.py``
(``build_model``/``make_batch``, Adam lr 1e-3 + StepLR(100, 0.5), one intra-op thread, gloo, the
gradients averaged by one flat all-reduce; rank r trains shard r).

Two modes:

``--mode inprocess``: ``nvidia_resiliency_ext.inprocess.Wrapper`` around the training function,
set up as its ``examples/inprocess/optimal_example.py`` does (model and optimizer built once,
outside the wrapped function; a base TCPStore on MASTER_PORT+2 reused through a ``PrefixStore``
per restart iteration; the Wrapper's own store on MASTER_PORT+1; ``CudaHealthCheck``, a no-op
without CUDA). The processes are started by ``peers_nvrx.py`` itself with the standard
RANK/WORLD_SIZE/MASTER_* variables (the usage guide: torchrun kills every local worker when one
dies, which defeats in-process restart). Hot spares: 3 "nodes" x PPN ranks with a ``Tree`` rank
assignment (the example in its docstring): at most ACTIVE ranks active, a node whose healthy
ranks fall below PPN is discarded whole, and its ranks are replaced by the idle node's (reserve)
ranks. State on restart: copied from a survivor, the new rank 0, by one broadcast of the
parameters, Adam's moments and step counts, the LR and the step counter (the spare's Adam state
is allocated up front so the broadcast lands in place); the commit (optimizer step + counter) is
inside ``call_wrapper.atomic()`` so the restart cannot split it.

``--mode ftl``: run by ``ft_launcher`` (its torchrun-like launcher with in-job restarts): a
``RankMonitorClient`` connected to the rank monitor, a heartbeat per step, a disk checkpoint
(model, optimizer, scheduler, step, the client's ``state_dict``) every ``--ckpt-every`` steps
written by rank 0, as its ``examples/fault_tolerance/train_ddp_heartbeats_api.py`` does; every
restart reloads it.

Events: one JSON line each, appended to ``--events`` with one ``os.write``; ``rank`` is the rank
the training function sees (the Wrapper renumbers ranks), ``initial_rank`` the launch rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: inprocess.Wrapper settings (seconds) and the gloo timeout. "documented": the Wrapper's defaults,
#: with the 10 s gloo timeout of its CPU examples. "tuned": as low as a healthy run here allows
#: (its constructor enforces soft < hard < barrier, heartbeat_interval < heartbeat_timeout, and the
#: monitor intervals below the timeouts). The gloo timeout is the lever (a rank blocked on the dead
#: one waits it out); it also bounds the new group's rendezvous, so at 0.5 s a re-formation under a
#: load average of 11 timed out and cost a second restart (7.3 s instead of 1.7 s): 1 s. The
#: heartbeat timeout only catches a rank whose monitor process died too (a lost node), and is left
#: at its default: at 1 s and at 5 s it flagged healthy ranks at an iteration's start under load,
#: and that path crashes every rank in 0.4.1 (its sibling monitor passes ``get_initial_ranks``'
#: bytes to the termination barrier, which then fails to parse "b'5'"; unchanged up to 0.6.0). The
#: barrier timeouts (above it, as the constructor requires) cost nothing on the recovery path. Soft/hard progress timeouts at 2/3 s restarted a
#: healthy job at start-up under a load average of 15 (a main thread blocked > 2 s): 5/8 s.
INPROCESS_PROFILES: dict[str, dict[str, float]] = {
    "documented": dict(
        monitor_thread_interval=1.0,
        monitor_process_interval=1.0,
        heartbeat_interval=1.0,
        progress_watchdog_interval=1.0,
        soft_timeout=60.0,
        hard_timeout=90.0,
        heartbeat_timeout=30.0,
        barrier_timeout=120.0,
        completion_timeout=120.0,
        last_call_wait=1.0,
        termination_grace_time=5.0,
        gloo_timeout=10.0,
    ),
    "tuned": dict(
        monitor_thread_interval=0.05,
        monitor_process_interval=0.05,
        heartbeat_interval=0.1,
        progress_watchdog_interval=0.05,
        soft_timeout=5.0,
        hard_timeout=8.0,
        heartbeat_timeout=30.0,
        barrier_timeout=60.0,
        completion_timeout=60.0,
        last_call_wait=0.05,
        termination_grace_time=0.0,
        gloo_timeout=1.0,
    ),
}

_EVENTS_FD: int | None = None
_IDENT: dict[str, Any] = {}


def emit(event: str, **fields: Any) -> None:
    """Append one JSON line (one write, O_APPEND: lines of several processes never interleave)."""
    if _EVENTS_FD is None:
        return
    rec = {
        "event": event,
        "t_wall": time.time(),
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", -1)),
        **_IDENT,
        **fields,
    }
    os.write(_EVENTS_FD, (json.dumps(rec) + "\n").encode())


def _fault(kind: str, step: int) -> None:
    emit("fault_injected", step=step, fault=kind)
    os.kill(os.getpid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def _flat_allreduce_grads(params: list[Any], world: int) -> None:
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[off : off + n].view_as(p))
        off += n


# ---- in-process restart ----------------------------------------------------------------------
def _init_adam_state(opt: Any) -> None:
    """Allocate Adam's state now (what its first step would), so a spare can receive it in place."""
    import torch

    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _copy_state_from_rank0(model: Any, opt: Any, sched: Any, progress: dict[str, int]) -> int:
    """Broadcast rank 0's training state to every rank; returns the bytes sent."""
    import torch
    import torch.distributed as dist

    tensors = []
    for p in model.parameters():
        st = opt.state[p]
        tensors += [p.data, st["exp_avg"], st["exp_avg_sq"], st["step"].view(1)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    # float64: the LR must arrive bit-exact (float32 would round it on every rank but rank 0)
    meta = torch.tensor([progress["step"], sched.last_epoch, opt.param_groups[0]["lr"]], dtype=torch.float64)
    dist.broadcast(flat, 0)
    dist.broadcast(meta, 0)
    off = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[off : off + n].view_as(t))
            off += n
    progress["step"] = int(meta[0])
    sched.last_epoch = int(meta[1])
    for group in opt.param_groups:
        group["lr"] = float(meta[2])
    return flat.numel() * flat.element_size() + meta.numel() * 8


def train_inprocess(
    base_store: Any,
    model: Any,
    opt: Any,
    sched: Any,
    progress: dict[str, int],
    a: argparse.Namespace,
    call_wrapper: Any = None,
) -> None:
    """The function the Wrapper restarts; ``call_wrapper`` is injected by it (see below)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(REPO))
    from examples.train import make_batch

    prof = INPROCESS_PROFILES[a.profile]
    it = call_wrapper.iteration
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _IDENT["iteration"] = it
    emit("iteration_start", world=world, monitor_pid=call_wrapper.monitor_process.process_monitor_proc.pid)
    t0 = time.time()
    store = torch.distributed.PrefixStore(str(it), base_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=prof["gloo_timeout"])
    )
    t_group = time.time()
    sent = _copy_state_from_rank0(model, opt, sched, progress) if it > 0 else 0
    emit("resumed", step=progress["step"], world=world, group_s=t_group - t0, copy_s=time.time() - t_group, bytes=sent)

    params = list(model.parameters())
    while progress["step"] < a.steps:
        step = progress["step"]
        if it == 0 and _IDENT["initial_rank"] == a.kill_rank and step == a.kill_at:
            _fault(a.fault, step)
        x, y = make_batch(a.seed, step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        _flat_allreduce_grads(params, world)
        with call_wrapper.atomic():  # no restart between the optimizer step and the counter
            opt.step()
            sched.step()
            progress["step"] = step + 1
        if rank == 0:
            emit("step", step=step + 1, participants=world)
    emit("done", step=progress["step"])
    dist.destroy_process_group()


def run_inprocess(a: argparse.Namespace) -> None:
    import logging
    from datetime import timedelta

    import nvidia_resiliency_ext.inprocess as inprocess
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext.inprocess.rank_assignment import Layer, LayerFlag, Tree

    sys.path.insert(0, str(REPO))
    from examples.train import build_model

    # the Wrapper logs through the root logger's handler, as its examples set up
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO)
    torch.set_num_threads(1)
    prof = INPROCESS_PROFILES[a.profile]
    model = build_model(a.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    _init_adam_state(opt)
    progress = {"step": 0}
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=port + 2,
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=int(os.environ["RANK"]) == 0,
        multi_tenant=True,
        wait_for_workers=True,
        use_libuv=True,
    )
    ppn = a.nproc_per_node
    rank_assignment = Tree(
        [
            # the job: exactly `active` ranks; fewer healthy ones than that ends it
            Layer(min_ranks=a.active, max_ranks=a.active, key_or_fn="root", flag=LayerFlag.RESERVE),
            # a node: all its ranks or none (resild fences the whole node too)
            Layer(min_ranks=ppn, max_ranks=ppn, key_or_fn=lambda s: str(s.initial_rank // ppn), flag=LayerFlag.RESERVE),
        ]
    )
    td = {k: timedelta(seconds=v) for k, v in prof.items() if k != "gloo_timeout"}
    wrapper = inprocess.Wrapper(
        store_kwargs={"port": port + 1},
        health_check=inprocess.health_check.CudaHealthCheck(),
        rank_assignment=rank_assignment,
        monitor_process_logfile=str(Path(a.logdir).resolve() / "monitor-{rank}.log"),
        **td,
    )
    # The Wrapper injects itself into the parameter annotated as CallWrapper; it compares
    # annotation objects, and `from __future__ import annotations` makes them strings.
    train_inprocess.__annotations__ = {"call_wrapper": inprocess.CallWrapper | None}
    emit("ready")
    wrapper(train_inprocess)(base_store, model, opt, sched, progress, a)
    emit("exit", step=progress["step"])


# ---- ft_launcher (in-job restart) ------------------------------------------------------------
def run_ftl(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from nvidia_resiliency_ext import fault_tolerance

    sys.path.insert(0, str(REPO))
    from examples.train import build_model, make_batch

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    torch.set_num_threads(1)
    ft_client = fault_tolerance.RankMonitorClient()
    ft_client.init_workload_monitoring()
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.gloo_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(a.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    start = 0
    if os.path.exists(a.ckpt):
        ck = torch.load(a.ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        ft_client.load_state_dict(ck["ft_state"])
        start = int(ck["step"])
    dist.barrier()  # every rank has read the checkpoint before rank 0 may overwrite it
    emit("resumed", step=start, world=world)
    params = list(model.parameters())
    for step in range(start, a.steps):
        if restart == 0 and rank == a.kill_rank and step == a.kill_at:
            _fault(a.fault, step)
        x, y = make_batch(a.seed, step, rank)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        _flat_allreduce_grads(params, world)
        opt.step()
        sched.step()
        ft_client.send_heartbeat()
        if rank == 0:
            emit("step", step=step + 1, participants=world)
            if (step + 1) % a.ckpt_every == 0:
                tmp = f"{a.ckpt}.tmp"
                torch.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "step": step + 1,
                        "ft_state": ft_client.state_dict(),
                    },
                    tmp,
                )
                os.replace(tmp, a.ckpt)  # a kill mid-write keeps the previous checkpoint
    emit("done", step=a.steps)
    ft_client.shutdown_workload_monitoring()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    global _EVENTS_FD
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("inprocess", "ftl"), required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=130)
    p.add_argument("--kill-rank", type=int, default=2, help="initial (launch) rank that gets the fault")
    p.add_argument("--fault", choices=("kill", "hang"), default="kill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", choices=tuple(INPROCESS_PROFILES), default="documented")
    p.add_argument("--active", type=int, default=4, help="inprocess: active ranks (the rest are spares)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="inprocess: ranks per simulated node")
    p.add_argument("--logdir", default=".", help="inprocess: the monitor processes' log files")
    p.add_argument("--ckpt", help="ftl: checkpoint file")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--gloo-timeout", type=float, default=60.0, help="ftl: gloo timeout, seconds")
    a = p.parse_args(argv)
    _EVENTS_FD = os.open(a.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _IDENT.update(
        initial_rank=int(os.environ.get("RANK", -1)),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        mode=a.mode,
    )
    emit("start")
    if a.mode == "inprocess":
        run_inprocess(a)
    else:
        run_ftl(a)


if __name__ == "__main__":
    main()
