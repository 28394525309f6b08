"""Replay bandwidth against a plain loopback copy of the same bytes (issue 17, item 4).

One source (2 processes) or two sources striping (3 processes) send a training state to
one receiver over a real gloo group formed the way resild forms it
(``launcher.worker.torch_private.backend_group`` over a TCPStore served by this
process, gloo on 127.0.0.1). The state looks like one FSDP shard's: a model of
``--layers`` layers (attention and MLP matrices, norms, biases) plus AdamW state
(``exp_avg``, ``exp_avg_sq``, a scalar ``step`` per parameter), scheduler, RNG and a
loader cursor as aux; a few hundred tensors, sized to ``--mb`` in total.

Paths, timed on the receiver from a barrier to the last byte usable:

- ``direct``: ``P2PTransport.exchange`` as ``RecoverySequence.replay`` drives it (each wait
  through ``RecoverySequence.wait``, which watches the epoch): tensors sent from their own
  storage, received into the tensors handed back, checksummed on both sides.
- ``direct_mac``: ``direct`` with the job's data key: every message tagged (Poly1305 under a
  one-time key) instead of CRC-32'd, META's tag checked before it is parsed (issue 39).
- ``direct_prepared``: ``direct`` from a source prepared ahead, as the recovery has each survivor
  do while the epoch's groups form (``state_transport.prepare``: the state walked, its small
  tensors packed), checked ``unchanged`` as the replay checks it. The preparation is timed
  apart (``prepare_s``), before the barrier: it is off the replay's critical path.
- ``direct_spare``: what a spare pays to be restored: its model is built (the live
  parameters, touched, as after the training script's model construction; its
  optimizer holds no state yet), the exchange writes the parameters in place
  (``receive_into``), and the restore's copy into the model (``TrainState.restore``)
  finds nothing left to copy. Timed to the model restored.
- ``direct_spare_warm``: ``direct_spare`` with the host memory a spare's warm-up leaves
  (``launcher.worker.transport.landing_pool``: zeros of its optimizer state's shapes, touched before
  the fault, as the warm-up's optimizer step on stand-ins leaves them), so the moments,
  which have no live home, land in touched pages too. Filled before the barrier.
- ``direct_spare_copy``: the same spare as before stop 31: every tensor received into
  fresh memory, then the parameters copied into the model.
- ``direct_unfaulted``: ``direct`` without faulting the receiver's fresh pages in ahead
  of the bytes (``launcher.worker.transport.page_prefault``), as it was before: what that buys.
- ``flat``: the transport as it was before issue 17 (one flat buffer: snapshot, cat,
  CRC, header round trip, receive, CRC, unflatten clones), kept here to compare.
- ``loopback``: the yardstick, a plain gloo send/recv of the same number of bytes into a
  buffer reused across runs (warm), split over the same sources, no checksum.
- ``loopback_fresh``: the same into a freshly allocated buffer, as a replay must fill
  (page faults: what a spare pays for memory it never touched; on a VM that hands freed
  pages back to its host, that is most of a large copy's time).

Runs alternate ABBA (A B C, C B A, ...), ``--runs`` of each; ``ratio`` = loopback
seconds / path seconds (bandwidth of the path / loopback bandwidth), of the medians and
the median of each run pair; ``cpu_s``: CPU seconds of every process of the case (all
their threads, gloo's included), median per run, which a busy machine disturbs less. The receiver's state is checked bitwise once per path.
By default the processes set glibc's mmap threshold to 64 KB (``cold_heap``), so every
receive of 64 KB or more gets fresh pages as in a spare that never held this state;
with ``--warm-heap`` glibc keeps recycling the previous run's memory (optimistic).

Usage::

    .venv/bin/python bench/replay_bandwidth.py                   # 2.4 and 64 MB, 1 and 2 sources
    .venv/bin/python bench/replay_bandwidth.py --mb 64 --sources 1 --runs 15 --json
    .venv/bin/python bench/replay_bandwidth.py --paths direct loopback loopback_fresh

Nothing here asserts on timings: it reports what it measured.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import queue
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.multiprocessing as mp

from launcher.worker.replica_map import Transfer, slice_bounds
from launcher.worker.transport.codec import checksum, flatten, unflatten
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import Mac
from launcher.worker.transport.state_transport import P2PTransport, Received, prepare

PATHS = (
    "loopback",
    "loopback_fresh",
    "direct",
    "direct_mac",
    "direct_prepared",
    "direct_spare",
    "direct_spare_warm",
    "direct_spare_copy",
    "direct_unfaulted",
    "flat",
)
DEFAULT_PATHS = tuple(p for p in PATHS if p != "direct_unfaulted")


# ---- the state ---------------------------------------------------------------------------
def shard_state(mb: float, layers: int, width: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model shard + AdamW state of about `mb` MB (3 x the parameters), and its aux."""
    g = torch.Generator().manual_seed(1234)
    per_layer = mb * 1e6 / 3 / 4 / layers  # float32 parameters per layer
    rows = max(1, round((per_layer - 2 * width) / (12 * width)))
    model: dict[str, torch.Tensor] = {"embed.weight": torch.randn(4 * rows, width, generator=g)}
    for i in range(layers):
        for name, shape in (
            ("attn.wq.weight", (rows, width)),
            ("attn.wk.weight", (rows, width)),
            ("attn.wv.weight", (rows, width)),
            ("attn.wo.weight", (rows, width)),
            ("mlp.w1.weight", (4 * rows, width)),
            ("mlp.w2.weight", (rows, 4 * width)),
            ("norm1.weight", (width,)),
            ("norm2.weight", (width,)),
        ):
            model[f"layers.{i}.{name}"] = torch.randn(*shape, generator=g)
    model["head.weight"] = torch.randn(rows, width, generator=g)
    optim_state = {
        i: {
            "step": torch.tensor(float(100 + i)),
            "exp_avg": torch.randn(p.shape, generator=g),
            "exp_avg_sq": torch.rand(p.shape, generator=g),
        }
        for i, p in enumerate(model.values())
    }
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(optim_state)}]
    state = {
        "step": 100,
        "model": model,
        "optim": {"state": optim_state, "param_groups": groups},
        "sched": {"last_epoch": 100, "base_lrs": [1e-3], "_step_count": 101},
        "scaler": None,
    }
    rng = random.Random(7)
    aux = {
        "rng": torch.Generator().manual_seed(5).get_state(),
        "py_rng": rng.getstate(),
        "cuda_rng": None,
        "extra": {"cursor": 4242},
    }
    return state, aux


def state_bytes(state: Any) -> int:
    skel, buf = flatten(state)
    return buf.numel() + len(skel)


def tensor_count(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(tensor_count(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_count(v) for v in obj)
    return 0


def warmed(state: dict[str, Any], pool: LandingPool) -> LandingPool:
    """`pool` holding what a spare's warm-up leaves: its optimizer moments' memory, touched."""
    for st in state["optim"]["state"].values():
        for v in st.values():
            pool.add(torch.zeros_like(v))
    return pool


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


# ---- the transport before issue 17, kept to compare ---------------------------------------
class FlatTransport:
    """Main's P2PTransport before issue 17, verbatim but for names: one flat buffer."""

    H, SKEL, ASKEL, ABUF, SLICE, SUM = 1, 2, 3, 4, 5, 6

    def __init__(self, pg: Any, wait: Callable[[Any], None]) -> None:
        self.pg, self.wait = pg, wait

    def exchange(
        self, plan: list[Transfer], me: int, snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    ) -> Received | None:
        sends = [t for t in plan if t.src == me]
        recvs = sorted((t for t in plan if t.dst == me), key=lambda t: t.part)
        works: list[Any] = []
        keep: list[torch.Tensor] = []
        if sends:
            state, aux = snapshot()
            skel, buf = flatten(state, "cpu")
            askel, abuf = flatten(aux, "cpu")
            skel_t = torch.frombuffer(bytearray(skel), dtype=torch.uint8)
            askel_t = torch.frombuffer(bytearray(askel), dtype=torch.uint8)
            aux_sum = checksum(torch.cat([skel_t, askel_t, abuf]))
            header = torch.tensor([len(skel), buf.numel(), len(askel), abuf.numel(), aux_sum], dtype=torch.int64)
            keep += [buf, abuf, skel_t, askel_t, header]
            for t in sends:
                if t.part == 0:
                    works += [
                        self.pg.send([header], t.dst, self.H),
                        self.pg.send([skel_t], t.dst, self.SKEL),
                        self.pg.send([askel_t], t.dst, self.ASKEL),
                    ]
                    if abuf.numel():
                        works.append(self.pg.send([abuf], t.dst, self.ABUF))
                a, b = slice_bounds(buf.numel(), t.part, t.parts)
                if b > a:
                    s = torch.tensor([checksum(buf[a:b])], dtype=torch.int64)
                    keep.append(s)
                    works += [self.pg.send([s], t.dst, self.SUM), self.pg.send([buf[a:b]], t.dst, self.SLICE)]
        got = self._receive(recvs) if recvs else None
        for w in works:
            self.wait(w)
        return got

    def _receive(self, recvs: list[Transfer]) -> Received:
        t0 = time.monotonic()
        primary = recvs[0].src
        header = torch.zeros(5, dtype=torch.int64)
        self.wait(self.pg.recv([header], primary, self.H))
        n_skel, n_buf, n_askel, n_abuf, aux_sum = (int(x) for x in header.tolist())
        skel_t = torch.empty(n_skel, dtype=torch.uint8)
        askel_t = torch.empty(n_askel, dtype=torch.uint8)
        abuf = torch.empty(n_abuf, dtype=torch.uint8)
        buf = torch.empty(n_buf, dtype=torch.uint8)
        works = [self.pg.recv([skel_t], primary, self.SKEL), self.pg.recv([askel_t], primary, self.ASKEL)]
        if n_abuf:
            works.append(self.pg.recv([abuf], primary, self.ABUF))
        sums: list[tuple[int, int, int, torch.Tensor]] = []
        for t in recvs:
            a, b = slice_bounds(n_buf, t.part, t.parts)
            if b > a:
                s = torch.zeros(1, dtype=torch.int64)
                sums.append((t.src, a, b, s))
                works += [self.pg.recv([s], t.src, self.SUM), self.pg.recv([buf[a:b]], t.src, self.SLICE)]
        for w in works:
            self.wait(w)
        damaged = [src for src, a, b, s in sums if checksum(buf[a:b]) != int(s.item())]
        if checksum(torch.cat([skel_t, askel_t, abuf])) != aux_sum:
            damaged.append(primary)
        took = time.monotonic() - t0
        n = n_buf + n_abuf + n_skel + n_askel
        if damaged:
            return Received({}, {}, n, [t.src for t in recvs], took, tuple(sorted(set(damaged))))
        state = unflatten(skel_t.numpy().tobytes(), buf)
        aux = unflatten(askel_t.numpy().tobytes(), abuf)
        return Received(state, aux, n, [t.src for t in recvs], took)


def cold_heap() -> None:
    """glibc: serve every allocation of 64 KB or more with fresh pages (mmap) and return them
    when freed, as `MALLOC_MMAP_THRESHOLD_=65536` would; else each run would reuse the pages
    of the previous one, which a spare receiving its state for the first time has not got."""
    try:
        ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: the heap stays as it is


# ---- one process -------------------------------------------------------------------------
def _child(rank: int, world: int, port: int, args: dict[str, Any], out: Any) -> None:  # pragma: no cover - child
    torch.set_num_threads(1)
    if args["cold"]:
        cold_heap()
    from launcher.worker.recovery import RecoverySequence
    from launcher.worker.stable_group import GroupFactory, Interrupts
    from launcher.worker.torch_private import PrefixStore, backend_group, tcp_store
    from launcher.worker.transport import page_prefault as prefault

    timeout = timedelta(seconds=args["timeout_s"])
    store = PrefixStore("resild/e1/world/", tcp_store("127.0.0.1", port, timeout))
    pg = backend_group("gloo", store, rank, world, timeout, "127.0.0.1")
    rec = RecoverySequence(
        Interrupts(), GroupFactory("gloo", lambda: None, args["timeout_s"]), torch.device("cpu"), 0.0
    )

    def managed(w: Any) -> None:  # exactly what RecoverySequence.replay gives the transport
        rec.wait(w, untimed=True)

    def barrier() -> None:
        t = torch.zeros(1)
        pg.allreduce([t]).wait()

    receiver = world - 1
    linux = prefault._supported
    wall: dict[str, list[float]] = {}  # "mb/k/path" -> the receiver's seconds per run
    cpu: dict[str, list[float]] = {}  # -> this process's CPU seconds per run (all its threads: gloo's too)
    prep: dict[str, list[float]] = {}  # -> a source's seconds preparing, before the barrier (direct_prepared)
    info: dict[str, dict[str, Any]] = {}
    for mb in args["mb"]:
        state, aux = shard_state(mb, args["layers"], args["width"])

        def snapshot(state: dict[str, Any] = state, aux: dict[str, Any] = aux) -> tuple[dict[str, Any], dict[str, Any]]:
            return dict(state), dict(aux)  # as TrainState.state_view: new dicts, the live tensors

        nbytes = state_bytes(state) + state_bytes(aux)
        # A spare's built model (touched, other values), its optimizer empty: what it offers.
        spare = {**state, "step": 0, "model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        spare["optim"] = {"state": {}, "param_groups": state["optim"]["param_groups"]}
        warm_src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        warm_dst = torch.zeros(nbytes, dtype=torch.uint8)
        for k in args["sources"]:
            plan = [Transfer(s, receiver, s, k) for s in range(k)]
            for i in range(args["runs"] + 1):  # run 0 warms up (connections, allocator)
                order = list(args["paths"]) if i % 2 == 0 else list(reversed(args["paths"]))
                for path in order:
                    key = f"{mb}/{k}/{path}"
                    landing, offered = None, 0
                    if path.startswith("direct_spare") and rank == receiver:
                        for v in spare["model"].values():  # not yet restored (checked below)
                            v.zero_()
                        if path == "direct_spare_warm":
                            landing = warmed(state, LandingPool())
                            offered = landing.nbytes
                    prepared = None
                    if path == "direct_prepared" and rank < k:  # as RecoverySequence.form has it made
                        p0 = time.perf_counter()
                        prepared = prepare(snapshot, torch.device("cpu"), lambda: 1)
                        if i > 0:
                            prep.setdefault(key, []).append(time.perf_counter() - p0)
                    barrier()
                    t0, c0 = time.perf_counter(), time.process_time()
                    got = None
                    if path.startswith("loopback"):
                        if rank == receiver:
                            dst = warm_dst if path == "loopback" else torch.empty(nbytes, dtype=torch.uint8)
                            ws = [pg.recv([dst[slice(*slice_bounds(nbytes, s, k))]], s, 9) for s in range(k)]
                            for w in ws:
                                w.wait()
                        elif rank < k:
                            pg.send([warm_src[slice(*slice_bounds(nbytes, rank, k))]], receiver, 9).wait()
                    elif rank == receiver or rank < k:
                        prefault._supported = path != "direct_unfaulted" and linux  # the receiver's pages
                        mac = Mac(bytes(32)) if path == "direct_mac" else None  # a key for each run's names
                        tr: Any = (
                            P2PTransport(pg, torch.device("cpu"), managed, landing, mac, (1, i))
                            if path != "flat"
                            else None
                        )
                        tr = tr or FlatTransport(pg, managed)
                        into = (lambda: spare) if path in ("direct_spare", "direct_spare_warm") else None
                        if (
                            prepared is not None
                        ):  # the state is what was prepared: checked as RecoverySequence.replay does
                            assert prepared.unchanged()
                        if isinstance(tr, FlatTransport):
                            got = tr.exchange(plan, rank, snapshot)
                        else:
                            got = tr.exchange(plan, rank, snapshot, into, prepared)
                        if got is not None and path.startswith("direct_spare"):  # TrainState.restore's copy
                            for name, v in spare["model"].items():
                                src = got.state["model"][name]
                                if src.data_ptr() != v.data_ptr():
                                    v.copy_(src)
                    dt, dc = time.perf_counter() - t0, time.process_time() - c0
                    if i > 0 and (rank == receiver or rank < k):
                        cpu.setdefault(key, []).append(dc)
                        if rank == receiver:
                            wall.setdefault(key, []).append(dt)
                    if rank == receiver and key not in info:
                        info[key] = {
                            "path": path,
                            "mb_target": mb,
                            "bytes": nbytes,
                            "tensors": tensor_count(state) + tensor_count(aux),
                            "sources": k,
                        }
                    if got is not None and "bitwise_equal" not in info[key]:
                        restored = not path.startswith("direct_spare") or equal(spare["model"], state["model"])
                        info[key]["bitwise_equal"] = (
                            not got.damaged and equal(got.state, state) and equal(got.aux, aux) and restored
                        )
                        info[key]["in_place_bytes"], info[key]["landed_bytes"] = got.in_place, got.landed
                        info[key]["offered_bytes"] = offered  # what the warmed memory held
                    del got
            barrier()
    barrier()
    out.put({"rank": rank, "wall": wall, "cpu": cpu, "info": info, "prepare": prep})


def summarize(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case and path from every process's report."""
    recv = next(r for r in reports if r["wall"])
    rows = []
    for key, xs in recv["wall"].items():
        cpus = [r["cpu"][key] for r in reports if key in r["cpu"]]
        per_run = [sum(c) for c in zip(*cpus)]  # every process of the case, per run
        med = statistics.median(xs)
        row = dict(recv["info"][key])
        row.update(
            runs=len(xs),
            seconds=round(med, 6),
            min_s=round(min(xs), 6),
            max_s=round(max(xs), 6),
            mb_per_s=round(row["bytes"] / 1e6 / med, 1),
            cpu_s=round(statistics.median(per_run), 6),
        )
        preps = [x for r in reports for x in r.get("prepare", {}).get(key, [])]
        if preps:  # off the replay's critical path (while the groups form), so not in `seconds`
            row["prepare_s"] = round(statistics.median(preps), 6)
        lb = recv["wall"].get(key.rsplit("/", 1)[0] + "/loopback")
        if lb:
            row["ratio"] = round(statistics.median(lb) / med, 3)
            row["ratio_pairs"] = round(statistics.median(a / b for a, b in zip(lb, xs)), 3)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["mb_target"], r["sources"], PATHS.index(r["path"])))


# ---- where the time goes, without the wire ------------------------------------------------
def phases(mb: float, layers: int, width: int, runs: int, cold: bool) -> list[dict[str, Any]]:
    """Each step of both paths timed alone in this process (best of `runs`: what it costs
    when nothing else runs), for the state of `mb` MB."""
    import timeit

    from launcher.worker.transport import state_transport as tp
    from launcher.worker.transport.codec import assemble, parse, skeleton

    torch.set_num_threads(1)
    if cold:
        cold_heap()
    state, aux = shard_state(mb, layers, width)
    n = state_bytes(state) + state_bytes(aux)
    tr = tp.P2PTransport(None, torch.device("cpu"), lambda w: None)
    skel, buf = flatten(state)
    sender = tp._Sender(tr, 0, tp.Source(state, aux, torch.device("cpu")))
    msgs = sender._layout(1)[0]
    wires = [sender._wire(1, 0, j) for j in range(len(msgs))]
    skel_json = skeleton(state)[0]
    sk, specs = parse(skel_json)

    def source_prepare() -> list[torch.Tensor]:
        s = tp._Sender(tr, 0, tp.Source(state, aux, torch.device("cpu")))
        return [s._wire(1, 0, j) for j in range(len(s._layout(1)[0]))]

    def prepare_ahead() -> Any:
        return tp.prepare(lambda: (state, aux), torch.device("cpu"), lambda: 1)

    ready = prepare_ahead()

    def receiver_prepare() -> Any:
        lay = tp.layout(specs, len(specs), 1)
        into = tp._Destination(specs, torch.device("cpu"), lay)
        for m in lay.parts[0]:
            into.wire(m)
        return into

    into = receiver_prepare()
    src, dst = torch.randint(0, 255, (n,), dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    # A snapshot rollback (plain FSDP2): a survivor's live state (model and optimizer
    # state, touched), and a spare's (its model built, its optimizer empty).
    from launcher.worker.redundancy.snapshot_store import Frozen

    frozen = Frozen.capture(100, 0, state, aux)
    survivor = {**state, "model": {k: v.clone() for k, v in state["model"].items()}}
    survivor["optim"] = {
        "state": {i: {k: v.clone() for k, v in st.items()} for i, st in state["optim"]["state"].items()},
        "param_groups": state["optim"]["param_groups"],
    }
    spare = {**survivor, "optim": {"state": {}, "param_groups": state["optim"]["param_groups"]}}

    def thaw_then_restore(live: dict[str, Any]) -> Any:  # before stop 31: clones, then the model copied
        got, _ = frozen.thaw()
        for k, v in live["model"].items():
            v.copy_(got["model"][k])
        return got

    def thaw_into(
        live: dict[str, Any], landing: LandingPool | None = None
    ) -> Any:  # the restore's copy then finds the same memory
        return frozen.thaw_into(live, landing)

    pool = LandingPool()

    def refill() -> None:
        pool.clear()
        warmed(state, pool)

    steps: list[tuple[str, Callable[[], Any]] | tuple[str, Callable[[], Any], Callable[[], None]]] = [
        ("memcpy of the state's bytes, warm pages (what loopback's kernel copies do twice)", lambda: dst.copy_(src)),
        ("memcpy into fresh pages (a receiver's first touch)", lambda: torch.empty(n, dtype=torch.uint8).copy_(src)),
        ("CRC-32 of the state's bytes (each path: once per side)", lambda: checksum(src)),
        ("flat: source flatten (skeleton + cat)", lambda: (flatten(state), flatten(aux))),
        ("flat: receiver unflatten (a clone per tensor)", lambda: unflatten(skel, buf)),
        ("direct: source skeletons + META", lambda: tp._Sender(tr, 0, tp.Source(state, aux, torch.device("cpu")))),
        ("direct: source skeletons + META + layout + packing", source_prepare),
        ("direct: source prepared while the groups form (walk + packing)", prepare_ahead),
        ("direct: a prepared source's check that the state is unchanged", lambda: ready.unchanged()),
        ("direct: CRC-32 of every message", lambda: [checksum(w) for w in wires]),
        ("direct: receiver parse", lambda: parse(skel_json)),
        ("direct: receiver layout + allocation", receiver_prepare),
        ("direct: receiver views + assemble", lambda: assemble(sk, into.tensors())),
        ("snapshot: capture (the training thread's copy, CPU)", lambda: Frozen.capture(100, 0, state, aux)),
        ("rollback, survivor: thaw (a clone per tensor) + model copied in", lambda: thaw_then_restore(survivor)),
        ("rollback, survivor: thaw into the live state", lambda: thaw_into(survivor)),
        ("rollback, spare: thaw (a clone per tensor) + model copied in", lambda: thaw_then_restore(spare)),
        ("rollback, spare: thaw into the live model", lambda: thaw_into(spare)),
        ("rollback, spare: thaw into the live model + the warm-up's memory", lambda: thaw_into(spare, pool), refill),
    ]
    out = []
    for name, f, *setup in steps:
        best = min(timeit.repeat(f, setup=setup[0] if setup else "pass", number=1, repeat=max(3, runs)))
        out.append(
            {
                "mb": round(n / 1e6, 2),
                "tensors": tensor_count(state) + tensor_count(aux),
                "step": name,
                "ms": round(best * 1e3, 3),
            }
        )
    return out


# ---- the driver --------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    world = max(args.sources) + 1
    master = torch.distributed.TCPStore(
        "127.0.0.1", 0, world, True, timeout=timedelta(seconds=args.timeout), wait_for_workers=False
    )
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "launcher.worker.transport.state_transport", "launcher.worker.recovery"])
    q = ctx.Queue()
    spec = {
        "mb": args.mb,
        "sources": args.sources,
        "paths": args.paths,
        "runs": args.runs,
        "layers": args.layers,
        "width": args.width,
        "timeout_s": args.timeout,
        "cold": not args.warm_heap,
    }
    procs = [ctx.Process(target=_child, args=(r, world, master.port, spec, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        reports = [_report(q, procs, args.timeout * 4) for _ in procs]
        for p in procs:
            p.join(timeout=args.timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return summarize(reports)


def _report(q: Any, procs: list[Any], timeout_s: float) -> dict[str, Any]:
    """The next process's report; a process that died first fails the run at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            report: dict[str, Any] = q.get(timeout=0.5)
            return report
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a benchmark process exited with {dead[0]}") from None
    raise TimeoutError(f"no report within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, nargs="+", default=[2.4, 64.0], help="state sizes, MB (model + AdamW)")
    p.add_argument("--sources", type=int, nargs="+", default=[1, 2], help="sources striping one receiver's state")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(DEFAULT_PATHS))
    p.add_argument("--runs", type=int, default=9, help="timed runs of each path and case (median)")
    p.add_argument("--layers", type=int, default=16, help="model layers: 8 parameters each, x3 with AdamW")
    p.add_argument("--width", type=int, default=512, help="hidden width (norm sizes, matrix columns)")
    p.add_argument("--warm-heap", action="store_true", help="let glibc recycle the previous run's pages")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds: group timeout, and the run's bound")
    p.add_argument("--json", action="store_true", help="one JSON object per result line")
    p.add_argument("--phases", action="store_true", help="instead: each step's cost in this process, no wire")
    args = p.parse_args(argv)
    if args.phases:
        for mb in args.mb:
            for row in phases(mb, args.layers, args.width, args.runs, not args.warm_heap):
                print(json.dumps(row) if args.json else f"{row['mb']:7.2f} MB  {row['ms']:8.2f} ms  {row['step']}")
        return 0
    if "loopback" not in args.paths:
        args.paths = ["loopback", *args.paths]
    results = run(args)
    if args.json:
        for r in results:
            print(json.dumps(r), flush=True)
        return 0
    print(
        f"{'MB':>7} {'tensors':>7} {'src':>3} {'path':<18} {'median ms':>9} {'min-max ms':>15} {'MB/s':>7} "
        f"{'ratio':>6} {'pairs':>6} {'cpu ms':>7} ok"
    )
    for r in results:
        eq = r.get("bitwise_equal")  # True, False or None (not compared)
        ok = "-" if eq is None else "yes" if eq else "NO"
        if r.get("offered_bytes") and not r.get("landed_bytes"):
            ok += " (nothing landed in the warmed memory)"
        if "prepare_s" in r:
            ok += f" (prepared ahead in {r['prepare_s'] * 1e3:.2f} ms)"
        print(
            f"{r['bytes'] / 1e6:7.2f} {r['tensors']:7d} {r['sources']:3d} {r['path']:<18} {r['seconds'] * 1e3:9.2f} "
            f"{r['min_s'] * 1e3:7.2f}-{r['max_s'] * 1e3:7.2f} {r['mb_per_s']:7.0f} {r.get('ratio', math.nan):6.2f} "
            f"{r.get('ratio_pairs', math.nan):6.2f} {r['cpu_s'] * 1e3:7.1f} {ok}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
