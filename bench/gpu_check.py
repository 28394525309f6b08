"""One-command GPU check (issue 17, item 7): what resild's NCCL/CUDA paths cost on a real GPU.

    python bench/gpu_check.py            # ~2 min on one GPU; one JSON line on stdout, progress on stderr
    python bench/gpu_check.py --quick    # smaller sizes and fewer steps
    python bench/gpu_check.py --only replay_cuda,nccl_group

Four parts, each in its own try/except: a part that fails reports ``{"error": ...}`` and the
others still run. Without CUDA every part reports ``{"skipped": "no CUDA"}`` except
``replay_cuda``, which runs on the CPU with a small state to exercise the code.

- ``loop``: the ``examples/train.py`` model, data and Adam on CUDA, ``--warmup`` steps then
  ``--steps`` timed steps (the interval between consecutive step ends, CUDA synchronised
  at each), (a) plain, no resild: ``opt.step()``, and (b) under resild's worker runtime with
  world size 1: ``resil-run --local --nodes 1 --spares 0 --nproc-per-node 1`` (as
  ``python -m launcher.run.cli``) with ``RESILD_BACKEND=nccl``, the loop written as in the
  examples (``launcher.init(model, opt)``, ``for step in job.steps(n)``, ``job.commit()``).
  Each run is this file in a worker role, writing its medians to a file. ``ratio`` =
  resild / plain median step time. ``resil-run --local`` builds its NVML stand-in
  (``resild/health/fake_nvml.c``) whenever gcc is there and puts it first on the workers'
  ``LD_LIBRARY_PATH``, where NCCL, which loads ``libnvidia-ml.so.1``, finds it; the worker
  drops it from its own environment (re-exec, same pid) unless ``--keep-fake-nvml``, and
  ``nccl_group.fake_nvml`` tells whether NCCL works with it.
- ``snapshot_d2h``: ~1 GiB of float32 "parameters" copied into one pinned host buffer on a
  side CUDA stream (GB/s), a bf16 matmul loop on the default stream sized to take about as
  long, each alone and both together; ``overlap`` = (t_mm + t_copy - t_both) / min(t_mm,
  t_copy): 1 is perfect overlap, 0 none.
- ``replay_cuda``: ``launcher.worker.transport.codec.flatten`` of a model + Adam state (~256 MB,
  as ``TrainState.state_view`` lays it out) on CUDA and ``unflatten`` back on CUDA: GB/s each
  and bitwise equality. Adam keeps its ``step`` counters on the CPU next to CUDA parameters;
  the state is first flattened as it is (as the replay sends it) and, if that fails, again
  with every tensor on the GPU, so the part still measures. Then a snapshot rollback's
  restore of the same state the way before stop 31 (``rollback_thaw_*``: host clones, the
  moments moved to the GPU anew) and now (``rollback_thaw_into_*``: written into the live
  tensors): seconds and the device memory allocated beyond the live state at the peak.
- ``nccl_group``: a world-size-1 NCCL group built by resild's own path
  (``GroupFactory.build``: a ``PrefixStore`` per epoch over a loopback ``TCPStore`` client,
  ``torch_private.backend_group``): build, first all-reduce (NCCL connects lazily), the
  steady all-reduce raw and through the ``StableGroup`` wrapper, ``stable_group.abort()``,
  then a fresh group for the next epoch. Each collective the ``StableGroup`` forwards is
  issued once (names as torch's C++ calls them) to show which ones the installed torch
  serves. With 2 or more GPUs, two ranks: one is SIGKILLed while the other waits in an
  all-reduce, which ``abort()`` from another thread must release; then a new 1-rank group.

Top-level keys: torch, cuda, gpu, env, loop, snapshot_d2h, replay_cuda, nccl_group,
seconds. ``--budget-s`` (default 240) bounds the whole run: a part that would start too
late is skipped, and a watchdog prints the JSON and exits 0 if a part hangs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: make `bench`, `examples`, `launcher` importable
    sys.path.insert(0, str(REPO))

from bench.commands import resil_run  # noqa: E402
from bench.gpu_common import (  # noqa: E402
    REEXEC_MARK,
    SCRIPT,
    Run,
    _err,
    _median,
    _r,
    _sync,
    _tail,
    child_env,
    log,
)
from bench.gpu_nccl import part_nccl, worker_nccl_solo, worker_pair  # noqa: E402

PARTS = ("loop", "snapshot_d2h", "replay_cuda", "snapshot_stage", "nccl_group")


def part_loop(run: Run, cuda: bool, res: dict[str, Any]) -> dict[str, Any]:
    a = run.args
    if not cuda and not a.cpu_dev:
        return {"skipped": "no CUDA"}
    warmup, steps = (5, 20) if a.quick else (a.warmup, a.steps)
    res.update(device="cuda" if cuda else "cpu", warmup=warmup, timed_steps=steps)
    backend = "nccl" if cuda else "gloo"
    with tempfile.TemporaryDirectory(prefix="gpu-check-loop-") as d:
        common = [sys.executable, str(SCRIPT), "--role", "loop", "--warmup", str(warmup)]
        common += ["--steps", str(steps)] + (["--keep-fake-nvml"] if a.keep_fake_nvml else [])
        # (a) plain
        out = Path(d) / "plain.json"
        log(f"loop: plain, {warmup}+{steps} steps")
        rc, _, se = run.spawn([*common, "--mode", "plain", "--out", str(out)], child_env(), 120.0)
        res["plain"] = _read_worker(out, rc, se)
        # (b) resild, world size 1
        out = Path(d) / "resild.json"
        worker = [*common, "--mode", "resild", "--out", str(out)]
        cmd = resil_run(
            "--json", "--quiet", "--run-dir", str(Path(d) / "run"), nodes=1, spares=0, nproc_per_node=1, worker=worker
        )
        log(f"loop: resild (resil-run --local, RESILD_BACKEND={backend}), {warmup}+{steps} steps")
        t = time.monotonic()
        rc, so, se = run.spawn(cmd, child_env(RESILD_BACKEND=backend), 180.0)
        r = _read_worker(out, rc, se)
        r["resil_run_wall_s"] = round(time.monotonic() - t, 2)
        try:
            summary = json.loads(so)
            r["resil_run"] = {"exit_code": summary.get("exit_code"), "reason": summary.get("reason")}
        except ValueError:
            r["resil_run_stdout_tail"] = _tail(so, 800)
        res["resild"] = r
    p, q = res["plain"].get("median_step_ms"), res["resild"].get("median_step_ms")
    if p and q:
        res["ratio"] = round(q / p, 3)
        res["overhead_ms"] = round(q - p, 3)
    return res


def _read_worker(out: Path, rc: int, stderr: str) -> dict[str, Any]:
    r: dict[str, Any] = {"rc": rc}
    try:
        r.update(json.loads(out.read_text()))
    except (OSError, ValueError) as e:
        r["error"] = f"no result from the worker ({_err(e)})"
    if rc != 0 or "error" in r:
        r["stderr_tail"] = _tail(stderr)
    return r


def _strip_fake_nvml() -> None:
    """Workers of `resil-run --local` inherit its NVML stand-in first on LD_LIBRARY_PATH, where
    NCCL would load it; the loader reads LD_LIBRARY_PATH only at start, hence the re-exec."""
    if os.environ.get(REEXEC_MARK):
        return
    parts = os.environ.get("LD_LIBRARY_PATH", "").split(":")
    keep = [p for p in parts if Path(p).name != "fake-nvml"]
    if len(keep) == len(parts) and "FAKE_NVML_CONTROL" not in os.environ:
        return
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in keep if p)
    env.pop("FAKE_NVML_CONTROL", None)
    env[REEXEC_MARK] = "stripped-fake-nvml" if len(keep) != len(parts) else "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def worker_loop(a: argparse.Namespace) -> None:
    """One run of the loop: the examples/train.py model and data, Adam; plain or under resild."""
    if a.mode == "resild" and not a.keep_fake_nvml:
        _strip_fake_nvml()  # before torch (and so NCCL) is loaded
    fake_in_env = any(Path(p).name == "fake-nvml" for p in os.environ.get("LD_LIBRARY_PATH", "").split(":"))
    import torch
    import torch.nn.functional as F

    from examples.train import build_model, make_batch

    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(0).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    total = a.warmup + a.steps + 1
    ends: list[float] = []
    commits: list[float] = []
    info: dict[str, Any] = {"mode": a.mode, "device": str(dev)}
    if a.mode == "resild":
        import launcher  # resild

        t = time.perf_counter()
        job = launcher.init(model, opt)  # resild
        info.update(init_s=round(time.perf_counter() - t, 3), backend=job.backend, world_size=job.world_size)
        info["job_device"] = str(job.device)
        rank, steps_iter = job.rank, job.steps(total)  # resild
    else:
        rank, steps_iter = 0, iter(range(total))
    for step in steps_iter:
        x, y = make_batch(0, step, rank)
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]  # untyped in torch
        tc = time.perf_counter()
        if a.mode == "resild":
            job.commit()  # resild: all-reduce, vote, optimizer step
        else:
            opt.step()
        _sync(dev)
        te = time.perf_counter()
        ends.append(te)
        commits.append(te - tc)
    step_s = [b - a_ for a_, b in zip(ends[a.warmup : -1], ends[a.warmup + 1 :])]
    info.update(
        steps_run=len(ends),
        median_step_ms=_r(1e3 * (_median(step_s) or 0.0), 4),
        min_step_ms=_r(1e3 * min(step_s), 4) if step_s else None,
        median_commit_ms=_r(1e3 * (_median(commits[a.warmup + 1 :]) or 0.0), 4),
        fake_nvml_stripped=os.environ.get(REEXEC_MARK) == "stripped-fake-nvml",
        fake_nvml_in_env=fake_in_env,
    )
    if a.mode == "resild":
        info["step_after"] = job.step
    Path(a.out).write_text(json.dumps(info))
    if a.mode == "resild":
        job.close()  # resild


# ---- part 2: device-to-host snapshot copy and its overlap with compute ------------------------
def part_snapshot(run: Run, cuda: bool, res: dict[str, Any]) -> dict[str, Any]:
    if not cuda:
        return {"skipped": "no CUDA"}
    import torch

    a = run.args
    nbytes = (128 << 20) if a.quick else (a.snapshot_mib << 20)
    n_tensors = 16
    per = nbytes // n_tensors // 4
    nbytes = per * 4 * n_tensors
    dev = torch.device("cuda", 0)
    res.update(bytes=nbytes, tensors=n_tensors, dtype="float32")
    params = [torch.randn(per, device=dev) for _ in range(n_tensors)]
    t = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    res["pinned_alloc_s"] = _r(time.perf_counter() - t)
    views = list(host.split(per * 4))  # type: ignore[no-untyped-call]  # untyped in torch
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # untyped in torch
    main = torch.cuda.current_stream(dev)

    def copy() -> tuple[Any, Any]:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
        side.wait_stream(main)
        with torch.cuda.stream(side):
            e0.record()
            for p, v in zip(params, views):
                v.copy_(p.view(torch.uint8), non_blocking=True)
            e1.record()
        return e0, e1

    n = 4096 if a.quick else 8192
    ma = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mb = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mc = torch.empty(n, n, device=dev, dtype=torch.bfloat16)

    def mm(k: int) -> tuple[Any, Any]:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
        e0.record()
        for _ in range(k):
            torch.matmul(ma, mb, out=mc)
        e1.record()
        return e0, e1

    def timed(fn: Any) -> tuple[float, Any]:
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t, r

    timed(copy)  # warm-up
    timed(lambda: mm(3))
    t_one = statistics.median(timed(lambda: mm(5))[0] / 5 for _ in range(3))
    reps = 5
    t_copy = statistics.median(timed(copy)[0] for _ in range(reps))
    k = max(1, round(t_copy / t_one))
    t_mm = statistics.median(timed(lambda: mm(k))[0] for _ in range(reps))
    both: list[float] = []
    copy_in_both: list[float] = []
    mm_in_both: list[float] = []
    for _ in range(reps):
        dt, (c, m) = timed(lambda: (copy(), mm(k)))
        both.append(dt)
        copy_in_both.append(c[0].elapsed_time(c[1]) / 1e3)
        mm_in_both.append(m[0].elapsed_time(m[1]) / 1e3)
    t_both = statistics.median(both)
    flop = 2 * n**3 * k
    res.update(
        copy_s=_r(t_copy, 5),
        d2h_gbps=_r(nbytes / t_copy / 1e9, 2),
        matmul={"n": n, "count": k, "dtype": "bfloat16", "s": _r(t_mm, 5), "tflops": _r(flop / t_mm / 1e12, 1)},
        both_s=_r(t_both, 5),
        copy_s_during_matmul=_r(statistics.median(copy_in_both), 5),
        d2h_gbps_during_matmul=_r(nbytes / statistics.median(copy_in_both) / 1e9, 2),
        matmul_tflops_during_copy=_r(flop / statistics.median(mm_in_both) / 1e12, 1),
        overlap=_r((t_mm + t_copy - t_both) / min(t_mm, t_copy), 3),
    )
    ok = all(torch.equal(views[i].view(torch.float32).cpu(), params[i].cpu()) for i in (0, n_tensors - 1))
    res["copy_equal"] = bool(ok)
    return res


# ---- part 3: flatten / unflatten of a model + Adam state -----------------------------------
def part_replay(run: Run, cuda: bool, res: dict[str, Any]) -> dict[str, Any]:
    import torch

    from launcher.worker.transport.codec import flatten, unflatten

    a = run.args
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        target = (32 << 20) if a.quick else (a.replay_mib << 20)
    else:
        target = (4 << 20) if a.quick else (8 << 20)
    layers = 4
    # model + Adam's exp_avg and exp_avg_sq: 3 float32 copies of the parameters
    width = max(16, int((target / (3 * 4 * layers)) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=dev)).square().mean().backward()
    opt.step()
    # as TrainState.state_view lays it out
    state: dict[str, Any] = {"step": 1, "model": model.state_dict(), "optim": opt.state_dict(), "sched": None}
    state["scaler"] = None
    devices: dict[str, int] = {}
    _walk(state, lambda t: devices.__setitem__(str(t.device), devices.get(str(t.device), 0) + 1))
    res.update(device=str(dev), tensor_devices=devices, width=width, layers=layers)
    try:
        skel, buf = flatten(state)
        res["as_is"] = "ok"
    except Exception as e:
        # What the replay's flatten does with this state; measure on with every tensor on `dev`.
        res["as_is"] = {"error": _err(e)}
        log(f"replay_cuda: flatten of the state as it is failed ({_err(e)}); again with every tensor on {dev}")
        state = _map(state, lambda t: t.to(dev))
        res["moved_to_device"] = True
    fl: list[float] = []
    un: list[float] = []
    back: Any = None
    for _ in range(4):  # the first of each is a warm-up
        _sync(dev)
        t = time.perf_counter()
        skel, buf = flatten(state)
        _sync(dev)
        fl.append(time.perf_counter() - t)
        t = time.perf_counter()
        back = unflatten(skel, buf)
        _sync(dev)
        un.append(time.perf_counter() - t)
    n = buf.numel()
    f_s, u_s = statistics.median(fl[1:]), statistics.median(un[1:])
    equal, n_tensors, bad, moved = _compare(state, back)
    res.update(
        bytes=n,
        skeleton_bytes=len(skel),
        buffer_device=str(buf.device),
        flatten_s=_r(f_s, 5),
        flatten_gbps=_r(n / f_s / 1e9, 2),
        first_flatten_s=_r(fl[0], 5),
        unflatten_s=_r(u_s, 5),
        unflatten_gbps=_r(n / u_s / 1e9, 2),
        first_unflatten_s=_r(un[0], 5),
        tensors=n_tensors,
        equal=equal,
        mismatched=bad[:5],
        device_changed=moved[:5],
    )
    # resild's peer-memory snapshot of this state: the copy the training thread pays
    # (device to host) and the CRC the exchange thread computes.
    from launcher.worker.redundancy.snapshot_store import Frozen

    caps: list[float] = []
    frozen = None
    for _ in range(3):
        _sync(dev)
        t = time.perf_counter()
        frozen = Frozen.capture(1, 0, state, {"rng": torch.get_rng_state()})
        caps.append(time.perf_counter() - t)
    assert frozen is not None
    t = time.perf_counter()
    frozen.seal()
    crc_s = time.perf_counter() - t
    cap_s = statistics.median(caps[1:])
    res.update(
        snapshot_capture_s=_r(cap_s, 5),
        snapshot_capture_gbps=_r(frozen.nbytes / cap_s / 1e9, 2),
        snapshot_crc_gbps=_r(frozen.nbytes / crc_s / 1e9, 2),
    )
    res.update(_rollback_restore(model, opt, dev))
    return res


def _rollback_restore(model: Any, opt: Any, dev: Any) -> dict[str, Any]:
    """A snapshot rollback's restore (TrainState.restore) of this model + Adam state, the
    way before stop 31 (thaw: a host clone per tensor, then the model copied in and the
    optimizer's moments moved to the device anew) and now (thaw_into: every tensor written
    into the live one): seconds, and the device memory allocated beyond the live state at
    the peak (on CUDA; None elsewhere)."""
    import torch

    from launcher.worker.redundancy.snapshot_store import Frozen
    from launcher.worker.train_state import TrainState

    ts = TrainState(model, opt, device=dev)
    frozen = Frozen.capture(1, 0, ts.state_view(1), ts.capture_aux()).seal()
    out: dict[str, Any] = {}
    for name in ("thaw", "thaw_into", "thaw", "thaw_into", "thaw", "thaw_into"):
        _sync(dev)
        base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t = time.perf_counter()
        state, aux = frozen.thaw() if name == "thaw" else frozen.thaw_into(ts.state_view(1))[:2]
        ts.restore(state, aux)
        _sync(dev)
        took = time.perf_counter() - t
        del state, aux
        peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
        out.setdefault(f"rollback_{name}_s", []).append(took)
        out[f"rollback_{name}_peak_extra_bytes"] = peak
    for name in ("thaw", "thaw_into"):
        out[f"rollback_{name}_s"] = _r(statistics.median(out[f"rollback_{name}_s"][1:]), 5)
    live, want = ts.state_view(1)["model"], frozen.thaw()[0]["model"]
    out["rollback_equal"] = all(torch.equal(live[k].cpu(), want[k]) for k in want)
    return out


def part_stage(run: Run, cuda: bool, res: dict[str, Any]) -> dict[str, Any]:
    """resild's GPU snapshot (launcher/worker/redundancy/device_stager.py): the training thread's
    cost, the copy overlapping the next step's compute, and no tearing: the optimizer
    step after it waits for the copy, and the snapshot equals the state it was taken of."""
    if not cuda:
        return {"skipped": "no CUDA"}
    import torch

    from launcher.worker.redundancy.device_stager import DeviceStager
    from launcher.worker.redundancy.snapshot_store import Frozen

    dev = torch.device("cuda", 0)
    width, layers = (2048, 4) if run.args.quick else (4096, 8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device=dev)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()

    def state() -> tuple[dict[str, Any], dict[str, Any]]:
        return {"step": 1, "model": model.state_dict(), "optim": opt.state_dict()}, {"rng": torch.get_rng_state()}

    step()
    opt.step()
    stager = DeviceStager(dev)
    host_s, ready_s, both_s = [], [], []
    frozen = None
    for i in range(4):  # the first is a warm-up (pinned allocation)
        torch.cuda.synchronize()
        expect = Frozen.capture(1, 0, *state()).payload  # what the plain path copies
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        frozen = stager.capture(1, 0, *state(), busy=set())
        t1 = time.perf_counter()
        step()  # the next step's forward and backward run while the copy does
        stager.before_write()
        opt.step()  # must not tear the snapshot
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        frozen.wait_ready()
        t3 = time.perf_counter()
        if i:
            host_s.append(t1 - t0)
            both_s.append(t2 - t0)
            ready_s.append(t3 - t0)
        res["equal_to_state_at_capture"] = bool(torch.equal(frozen.payload, expect))
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        step()
        opt.step()
    torch.cuda.synchronize()
    alone_s = (time.perf_counter() - t) / 3
    assert frozen is not None
    nbytes = frozen.nbytes
    res.update(
        bytes=nbytes,
        capture_host_s=_r(statistics.median(host_s), 5),
        step_alone_s=_r(alone_s, 5),
        step_with_snapshot_s=_r(statistics.median(both_s), 5),
        overhead=_r(statistics.median(both_s) / alone_s - 1, 3),
        copy_gbps=_r(nbytes / max(1e-9, statistics.median(ready_s)) / 1e9, 2),
    )
    return res


def _walk(obj: Any, fn: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, fn)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, fn)


def _map(obj: Any, fn: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _compare(a: Any, b: Any, path: str = "") -> tuple[bool, int, list[str], list[str]]:
    """Bitwise: same structure, same plain values, each tensor the same dtype, shape and bytes.
    -> (equal, tensors compared, paths that differ, tensors whose device changed)."""
    import torch

    bad: list[str] = []
    moved: list[str] = []
    count = 0

    def go(x: Any, y: Any, p: str) -> None:
        nonlocal count
        if isinstance(x, torch.Tensor):
            count += 1
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape:
                bad.append(p)
                return
            if x.device != y.device:
                moved.append(f"{p}: {x.device} -> {y.device}")
            xb = x.detach().contiguous().reshape(-1).view(torch.uint8)
            yb = y.detach().contiguous().reshape(-1).view(torch.uint8).to(xb.device)
            if not torch.equal(xb, yb):
                bad.append(p)
        elif isinstance(x, dict):
            if not isinstance(y, dict) or list(x) != list(y):
                bad.append(p)
                return
            for k in x:
                go(x[k], y[k], f"{p}/{k}")
        elif isinstance(x, (list, tuple)):
            if type(x) is not type(y) or len(x) != len(y):
                bad.append(p)
                return
            for i, (u, v) in enumerate(zip(x, y)):
                go(u, v, f"{p}[{i}]")
        elif x != y or type(x) is not type(y):
            bad.append(p)

    go(a, b, path)
    return not bad, count, bad, moved


# ---- part 4: NCCL groups through resild's own path ------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer steps")
    p.add_argument("--only", help=f"comma-separated parts to run (of {', '.join(PARTS)})")
    p.add_argument("--budget-s", type=float, default=240.0, help="the whole run's limit (default 240)")
    p.add_argument("--warmup", type=int, default=10, help="loop: untimed steps (default 10)")
    p.add_argument("--steps", type=int, default=50, help="loop: timed steps (default 50)")
    p.add_argument("--snapshot-mib", type=int, default=1024, help="snapshot_d2h: bytes copied (default 1024 MiB)")
    p.add_argument("--replay-mib", type=int, default=256, help="replay_cuda: state size (default 256 MiB)")
    p.add_argument("--keep-fake-nvml", action="store_true", help="loop: leave resil-run's NVML stand-in to NCCL")
    p.add_argument(
        "--cpu-dev", action="store_true", help="development without a GPU: run loop and nccl_group on CPU with gloo"
    )
    # worker roles (this file runs itself)
    p.add_argument("--role", choices=("main", "loop", "nccl-solo", "pair"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=("plain", "resild"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.role == "loop":
        worker_loop(a)
        return 0
    if a.role == "nccl-solo":
        worker_nccl_solo(a)
        return 0
    if a.role == "pair":
        worker_pair(a)
        return 0
    parts = PARTS if not a.only else tuple(x.strip() for x in a.only.split(",") if x.strip())
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        raise SystemExit(f"gpu_check: unknown part(s) {unknown}; parts: {', '.join(PARTS)}")
    # stdout carries exactly one JSON line: anything else (C libraries included) goes to stderr
    json_fd = os.dup(1)
    os.dup2(2, 1)
    run = Run(a, json_fd)
    run.watchdog()
    import torch

    cuda = torch.cuda.is_available()
    r = run.result
    r["torch"] = torch.__version__
    r["cuda"] = cuda
    r["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    env: dict[str, Any] = {"python": sys.version.split()[0], "quick": a.quick, "torch_cuda": torch.version.cuda}
    if cuda:
        env["device_count"] = torch.cuda.device_count()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]  # untyped in torch
        except Exception as e:
            env["nccl"] = _err(e)
    r["env"] = env
    log(f"torch {torch.__version__}, cuda {cuda}, gpu {r['gpu']}")
    fns = {
        "loop": part_loop,
        "snapshot_d2h": part_snapshot,
        "replay_cuda": part_replay,
        "snapshot_stage": part_stage,
        "nccl_group": part_nccl,
    }
    min_left = {"loop": 60.0, "snapshot_d2h": 20.0, "replay_cuda": 10.0, "snapshot_stage": 15.0, "nccl_group": 30.0}
    for name in PARTS:
        if name not in parts:
            r[name] = {"skipped": "not in --only"}
            continue
        if run.left() < min_left[name] and (cuda or name == "replay_cuda"):
            r[name] = {"skipped": f"time budget: {run.left():.0f}s left"}
            continue
        run.current = name
        log(f"{name}: start")
        t = time.monotonic()
        res = r[name] = {}  # filled as the part goes: a failure or the watchdog keeps what it has
        try:
            r[name] = fns[name](run, cuda, res)
        except Exception as e:
            r[name] = {**res, "error": _err(e), "where": _tail(traceback.format_exc(), 1500)}
        if isinstance(r[name], dict) and "skipped" not in r[name]:
            r[name]["part_s"] = round(time.monotonic() - t, 2)
        run.current = None
        if cuda:
            torch.cuda.empty_cache()  # the part's tensors are gone with its frame
        log(f"{name}: done in {time.monotonic() - t:.1f}s")
    run.emit()
    sys.stderr.flush()
    os._exit(0)  # an aborted NCCL communicator may hang interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
