"""bench/gpu_check.py's NCCL part: a world-size-1 NCCL group through resild's own path
(formation, every collective StableGroup forwards, abort, re-formation), NCCL with
resil-run --local's NVML stand-in, and with two GPUs a rank killed mid all-reduce."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.gpu_common import (
    REPO,
    SCRIPT,
    Run,
    _err,
    _killpg,
    _r,
    _sync,
    _tail,
    child_env,
    log,
)


def part_nccl(run: Run, cuda: bool, res: dict[str, Any]) -> dict[str, Any]:
    a = run.args
    if not cuda and not a.cpu_dev:
        return {"skipped": "no CUDA"}
    import torch

    from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup, abort
    from launcher.worker.torch_private import CHECKED_WITH, tcp_store

    backend = "nccl" if cuda else "gloo"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    res.update(backend=backend, torch_private_checked_with=CHECKED_WITH)
    if cuda:  # first: a subprocess with a timeout, whatever happens in this process below
        res["fake_nvml"] = _guard(lambda: _fake_nvml_check(run))
    master = _master_store()
    port = master.port
    factory = GroupFactory(backend, lambda: tcp_store("127.0.0.1", port, timedelta(seconds=30)), 60.0)
    intr = Interrupts()
    sg = StableGroup("world", [0], 0, intr)
    sg.allow = True

    t = time.perf_counter()
    inner = factory.build(1, sg)
    res["build_s"] = _r(time.perf_counter() - t)
    sg.set_backend(inner)
    x = torch.ones(1 << 20, device=dev)
    t = time.perf_counter()
    inner.allreduce([x]).wait()
    _sync(dev)
    res["first_allreduce_s"] = _r(time.perf_counter() - t)  # NCCL: the communicator forms here
    res["allreduce_value_ok"] = bool(x[0].item() == 1.0)

    def steady(issue: Any, reps: int = 30) -> float:
        ts = []
        for _ in range(reps):
            _sync(dev)
            t = time.perf_counter()
            issue().wait()
            _sync(dev)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    small = torch.ones(1, device=dev)
    res["allreduce_1elem_raw_ms"] = _r(1e3 * steady(lambda: inner.allreduce([small])), 4)
    res["allreduce_1elem_stable_group_ms"] = _r(1e3 * steady(lambda: sg.allreduce([small])), 4)
    res["latched_error"] = intr.error

    t = time.perf_counter()
    abort(inner)
    res["abort_s"] = _r(time.perf_counter() - t, 6)

    # the next epoch: a fresh backend under a new store prefix (resild/e2/world/)
    t = time.perf_counter()
    inner2 = factory.build(2, sg)
    t_built = time.perf_counter()
    sg.set_backend(inner2)
    intr.clear()
    y = torch.ones(1 << 20, device=dev)
    inner2.allreduce([y]).wait()
    _sync(dev)
    t_end = time.perf_counter()
    res["reform"] = {
        "build_s": _r(t_built - t),
        "first_allreduce_s": _r(t_end - t_built),
        "total_s": _r(t_end - t),
        "value_ok": bool(y[0].item() == 1.0),
    }
    res["stable_group_collectives"] = _guard(lambda: _collectives(sg, intr, dev))
    # What a recovery does now (launcher/worker/old_backends.py): the old communicator aborts
    # in a thread while the next one forms; the fence waits for the abort before the new one
    # is used (and NCCL connects in that first collective). Serial cost: abort_s +
    # reform.total_s above; with the abort in a thread: total_s here.
    res["reform_overlapped"] = _guard(lambda: _overlapped(factory, sg, inner2, dev))
    ngpu = torch.cuda.device_count() if cuda else 0
    if ngpu >= 2 or a.cpu_dev:
        res["two_ranks"] = _guard(lambda: _pair(run, "nccl" if cuda else "gloo"))
    else:
        res["two_ranks"] = {"skipped": f"{ngpu} GPU(s); the kill test needs 2"}
    return res


def _overlapped(factory: Any, sg: Any, old_inner: Any, dev: Any) -> dict[str, Any]:
    import torch

    from launcher.worker.old_backends import OldBackends
    from launcher.worker.stable_group import abort

    old = OldBackends(abort, bury_s=0.0)
    t = time.perf_counter()
    old.abort([old_inner], fenced=True)
    inner = factory.build(3, sg)
    t_built = time.perf_counter()
    fence_s = old.fence(60.0)
    sg.set_backend(inner)
    z = torch.ones(1 << 20, device=dev)
    inner.allreduce([z]).wait()
    _sync(dev)
    t_end = time.perf_counter()
    abort(inner)
    return {
        "build_s": _r(t_built - t),
        "fence_wait_s": _r(fence_s, 6),
        "total_s": _r(t_end - t),
        "value_ok": bool(z[0].item() == 1.0),
    }


def _guard(fn: Any) -> Any:
    """A sub-check whose failure must not take the part's other figures with it."""
    try:
        return fn()
    except Exception as e:
        return {"error": _err(e), "where": _tail(traceback.format_exc(), 1200)}


def _master_store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def _collectives(sg: Any, intr: Any, dev: Any) -> dict[str, str]:
    """Issue each collective the StableGroup forwards, under the name torch's C++ calls it by
    (both names where they differ between torch versions): "ok" or the error it latched."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions

    def t() -> Any:
        return torch.ones(4, device=dev)

    calls: dict[str, Any] = {
        "allreduce": lambda: sg.allreduce([t()], dist.AllreduceOptions()),
        "allgather": lambda: sg.allgather([[t()]], [t()], AllgatherOptions()),
        "_allgather_base (2.11 C++ name)": lambda: sg._allgather_base(t(), t(), AllgatherOptions()),
        "all_gather_single (2.13 C++ name)": lambda: sg.all_gather_single(t(), t(), AllgatherOptions()),
        "allgather_into_tensor_coalesced": lambda: sg.allgather_into_tensor_coalesced([t()], [t()], AllgatherOptions()),
        "reduce_scatter": lambda: sg.reduce_scatter([t()], [[t()]], dist.ReduceScatterOptions()),
        "_reduce_scatter_base (2.11 C++ name)": lambda: sg._reduce_scatter_base(t(), t(), dist.ReduceScatterOptions()),
        "reduce_scatter_single (2.13 C++ name)": lambda: sg.reduce_scatter_single(
            t(), t(), dist.ReduceScatterOptions()
        ),
        "reduce_scatter_tensor_coalesced": lambda: sg.reduce_scatter_tensor_coalesced(
            [t()], [t()], dist.ReduceScatterOptions()
        ),
        "alltoall_base (2.11 C++ name)": lambda: sg.alltoall_base(t(), t(), [], [], dist.AllToAllOptions()),
        "all_to_all_single (2.13 C++ name)": lambda: sg.all_to_all_single(t(), t(), [], [], dist.AllToAllOptions()),
        "broadcast": lambda: sg.broadcast([t()], dist.BroadcastOptions()),
        "barrier": lambda: sg.barrier(dist.BarrierOptions()),
    }
    out: dict[str, str] = {}
    for name, call in calls.items():
        intr.clear()
        try:
            call().wait()
            _sync(dev)
            out[name] = "ok" if intr.error is None else intr.error[:300]
        except Exception as e:
            out[name] = _err(e)[:300]
    intr.clear()
    return out


def _fake_nvml_check(run: Run) -> dict[str, Any]:
    """Does NCCL work with resil-run --local's NVML stand-in first on LD_LIBRARY_PATH?"""
    try:
        from resild.health.fakenvml import build_fake_nvml
    except Exception as e:
        return {"skipped": f"cannot import the stand-in's builder: {_err(e)}"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-nvml-") as d:
        try:
            lib = build_fake_nvml(Path(d) / "fake-nvml")
        except Exception as e:
            return {"skipped": f"no NVML stand-in, so resil-run --local uses none either: {_err(e)[:300]}"}
        ctl = Path(d) / "nvml.ctl"
        ctl.write_text("gpus 1\n")
        env = child_env(
            LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
            FAKE_NVML_CONTROL=str(ctl),
            NCCL_DEBUG="WARN",
        )
        t = time.monotonic()
        log("nccl_group: NCCL with the NVML stand-in on LD_LIBRARY_PATH (as resil-run --local's workers)")
        rc, so, se = run.spawn([sys.executable, str(SCRIPT), "--role", "nccl-solo"], env, 90.0)
        r: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - t, 2)}
        try:
            r.update(json.loads(so.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            r["ok"] = False
        if rc != 0 or not r.get("ok"):
            r["stderr_tail"] = _tail(se, 2000)
        return r


def worker_nccl_solo(a: argparse.Namespace) -> None:
    import torch

    from launcher.worker.torch_private import backend_group, hash_store

    out: dict[str, Any] = {"ok": False}
    try:
        pg = backend_group("nccl", hash_store(), 0, 1, timedelta(seconds=60), None)
        x = torch.ones(1 << 10, device="cuda")
        t = time.perf_counter()
        pg.allreduce([x]).wait()
        torch.cuda.synchronize()
        out.update(ok=bool(x[0].item() == 1.0), first_allreduce_s=_r(time.perf_counter() - t))
    except Exception as e:
        out["error"] = _err(e)
    print(json.dumps(out), flush=True)
    os._exit(0)


# ---- two ranks: one SIGKILLed mid all-reduce -------------------------------------------------
def _pair(run: Run, backend: str) -> dict[str, Any]:
    master = _master_store()
    res: dict[str, Any] = {"backend": backend}
    with tempfile.TemporaryDirectory(prefix="gpu-check-pair-") as d:
        outs = [Path(d) / f"rank{r}.json" for r in (0, 1)]
        env = child_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2")  # as the node process sets it
        procs = []
        errs = []
        for r in (0, 1):
            cmd = [sys.executable, str(SCRIPT), "--role", "pair", "--rank", str(r)]
            cmd += ["--port", str(master.port), "--backend", backend, "--out", str(outs[r])]
            err = open(Path(d) / f"rank{r}.err", "wb")  # closed below
            errs.append(err)
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=err, stderr=err, start_new_session=True)
            procs.append(p)
            run.procs.append(p)
        try:
            deadline = time.monotonic() + min(120.0, run.left() - 10)
            while not master.check(["r0_waiting"]):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the ranks did not reach the all-reduce")
                time.sleep(0.05)
            time.sleep(0.5)  # rank 0 is inside its wait now
            t_kill = time.time()
            os.kill(procs[1].pid, signal.SIGKILL)
            master.set("killed", repr(t_kill))
            log(f"nccl_group: rank 1 SIGKILLed while rank 0 waits in an all-reduce ({backend})")
            try:
                procs[0].wait(timeout=max(5.0, min(90.0, run.left() - 10)))
            except subprocess.TimeoutExpired:
                res["error"] = "rank 0 did not finish within 90 s"
            try:
                res.update(json.loads(outs[0].read_text()))
            except (OSError, ValueError) as e:
                res.setdefault("error", f"no result from rank 0 ({_err(e)})")
        finally:
            for p in procs:
                _killpg(p)
                p.wait()
                run.procs.remove(p)
            for f in errs:
                f.close()
        if "error" in res:
            res["rank0_stderr_tail"] = _tail((Path(d) / "rank0.err").read_text(errors="replace"), 2000)
    return res


def worker_pair(a: argparse.Namespace) -> None:
    import torch

    from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup, abort
    from launcher.worker.torch_private import tcp_store

    rank, backend = a.rank, a.backend
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    def client() -> Any:
        return tcp_store("127.0.0.1", a.port, timedelta(seconds=60))

    store = client()
    intr = Interrupts()
    sg = StableGroup("world", [0, 1], rank, intr)
    sg.allow = True
    factory = GroupFactory(backend, client, 60.0)
    out: dict[str, Any] = {}
    t = time.perf_counter()
    inner = factory.build(1, sg)
    sg.set_backend(inner)
    x = torch.ones(1 << 20, device=dev)
    sg.allreduce([x]).wait()
    _sync(dev)
    out["form_and_first_allreduce_s"] = _r(time.perf_counter() - t)
    out["warm_value_ok"] = bool(x[0].item() == 2.0)
    store.set(f"ready{rank}", "1")
    store.wait(["ready0", "ready1"])
    if rank == 1:
        time.sleep(600)  # SIGKILLed by the parent
        os._exit(1)
    released = threading.Event()
    marks: dict[str, float] = {}

    def aborter() -> None:
        c = client()
        c.wait(["killed"], timedelta(seconds=120))
        marks["kill_wall"] = float(c.get("killed").decode())
        marks["seen_wall"] = time.time()
        marks["abort_t0"] = time.perf_counter()
        abort(inner)  # resild's: swallows errors
        marks["abort_t1"] = time.perf_counter()
        if not released.wait(20.0):
            marks["fallback_t"] = time.perf_counter()
            intr.fail("gpu_check: abort() did not release the wait within 20 s")

    th = threading.Thread(target=aborter, daemon=True)
    th.start()
    y = torch.ones(1 << 20, device=dev)
    w = sg.allreduce([y])
    store.set("r0_waiting", "1")
    w.wait()
    t_rel = time.perf_counter()
    released.set()
    th.join(5.0)
    t_abort = marks.get("abort_t0")
    if "fallback_t" in marks:
        by = "intr.fail() fallback: abort() did not release the wait within 20 s"
    elif t_abort is None or t_rel < t_abort:
        by = "the backend's own error, before abort() was called"
    else:
        by = "after abort() was called (latched_error says what released it)"
    out.update(
        released_by=by,
        kill_to_abort_call_s=_r(marks["seen_wall"] - marks["kill_wall"]) if "seen_wall" in marks else None,
        abort_call_s=_r(marks["abort_t1"] - marks["abort_t0"], 6) if "abort_t1" in marks else None,
        abort_to_release_s=_r(t_rel - t_abort, 6) if t_abort is not None else None,
        latched_error=(intr.error or "")[:300] or None,
    )
    Path(a.out).write_text(json.dumps(out))  # so far, in case what follows hangs
    if dev.type == "cuda":  # do the device's queues drain after the abort?
        done = threading.Event()
        t = time.perf_counter()

        def drain() -> None:
            torch.cuda.synchronize(dev)
            done.set()

        threading.Thread(target=drain, daemon=True).start()
        ok = done.wait(20.0)
        out["cuda_sync_after_abort"] = f"returned in {time.perf_counter() - t:.3f}s" if ok else "hung for 20 s"
        Path(a.out).write_text(json.dumps(out))
        if not ok:
            os._exit(0)
    # a fresh 1-rank group for the next epoch
    intr.clear()
    solo = StableGroup("world-solo", [0], 0, intr)
    solo.allow = True
    t = time.perf_counter()
    inner2 = factory.build(2, solo)
    solo.set_backend(inner2)
    z = torch.ones(1 << 20, device=dev)
    solo.allreduce([z]).wait()
    _sync(dev)
    out["reform_1rank_s"] = _r(time.perf_counter() - t)
    out["reform_value_ok"] = bool(z[0].item() == 1.0) and intr.error is None
    Path(a.out).write_text(json.dumps(out))
    os._exit(0)  # an aborted communicator may hang interpreter teardown


# ---- main ---------------------------------------------------------------------------------
