"""Every private torch API the worker touches, and nothing else: a torch upgrade reads this file.

Each entry names the torch version it was checked against and what breaks if it
changes. Checked against torch 2.13.0 (CPU build, gloo; the NCCL paths follow
the same c10d code). The `# type: ignore`s here are for torch's stubs, which
describe the user-facing signatures and not these internals.

Public APIs that merely lack a stub export (the stores) are here too, so the
rest of the worker needs no ignores.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch 2.13: the option structs and stores live in torch._C._distributed_c10d. AllgatherOptions is
# not re-exported by torch.distributed; HashStore/TCPStore are, but not in a way mypy accepts.
from torch._C._distributed_c10d import AllgatherOptions, HashStore, Store, TCPStore
from torch.distributed.distributed_c10d import GroupName, PrefixStore

CHECKED_WITH = "2.13.0"

# gloo (torch 2.13's, gloo/transport/tcp/context.cc) reads its peers' addresses with one
# `multi_get` per 128 ranks when this is "1" and the store says `has_extended_api()`
# (LinkStore does), else with a wait and a get per rank, its own included: 2W + 1 store
# round trips per rank and group through the controller, 2 with it. gloo reads it with
# getenv at every formation; resild sets it in its workers unless the job's environment
# already says (`gloo_batched_reads`).
GLOO_STORE_V2 = "GLOO_ENABLE_STORE_V2_API"


def gloo_batched_reads(env: MutableMapping[str, str]) -> bool:
    """Let gloo read a group's addresses with one `multi_get` (GLOO_STORE_V2), unless the
    job's environment sets the variable itself (`=0` turns it off). True if it is on."""
    env.setdefault(GLOO_STORE_V2, "1")
    return env[GLOO_STORE_V2] == "1"


__all__ = [
    "CHECKED_WITH",
    "GroupName",
    "PrefixStore",
    "PyProcessGroup",
    "PyWork",
    "allgather_into",
    "backend_group",
    "ddp_bucket_cap_bytes",
    "ddp_logging_data",
    "ddp_reset_reducer",
    "device_mesh_from_groups",
    "gloo_batched_reads",
    "gloo_reduce_scatter",
    "hash_store",
    "prewarm_lazy_imports",
    "private_device_mesh",
    "register_group",
    "refresh_fsdp_meshes",
    "replace_default_group",
    "reshape_device_mesh",
    "scaler_found_inf",
    "scaler_reset_stages",
    "scaler_unscaled",
    "fake_default_group",
    "fake_group",
    "strided_shard_type",
    "submesh_dims",
    "WarmShardings",
    "tcp_store",
]


# ---- stores (public, stub export only) -----------------------------------------------
def hash_store() -> Store:
    """torch 2.13: torch.distributed.HashStore (an in-memory Store, solo runs)."""
    return HashStore()


def tcp_store(host: str, port: int, timeout: timedelta) -> Store:
    """torch 2.13: a TCPStore client (never the master; the controller serves the store)."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)


# ---- c10d: works and process groups implemented in Python --------------------------
# torch 2.13: torch.distributed.Work (alias dist._Work) may be subclassed in Python; the
# pybind trampoline (PyProcessGroup::PyWork) routes C++ wait()/get_future() (DDP's reducer
# waits on get_future() in C++) to the Python overrides. If the trampoline goes, C++ callers
# would see the base Work (never completing) while Python callers still work.
PyWork = dist.Work


def _op(g: Any, name: str, older: str) -> Any:
    """The backend group's method `name` (torch 2.13), or its older C++ name (torch 2.11
    binds `_allgather_base`, `_reduce_scatter_base`, `alltoall_base`, `*_tensor_coalesced`;
    seen on a GPU machine by bench/gpu_check.py). Neither: an AttributeError that latches."""
    fn = getattr(g, name, None)
    return fn if fn is not None else getattr(g, older)


class PyProcessGroup(dist.ProcessGroup):
    """Base of a process group implemented in Python.

    torch 2.13: pybind's ProcessGroup has a `(rank, size)` constructor for Python
    subclasses (the stubs list only `(store, rank, size)`), and its trampoline
    (torch/csrc/distributed/c10d/PyProcessGroup.hpp) routes each collective that
    C++ issues (DDP's reducer, functional collectives, DeviceMesh) to the Python
    method of the same name, called `(tensors..., opts)`. Each method below
    forwards to `_run` (StableGroup implements it). The stubs describe the
    user-facing overloads instead, hence the `ignore[override]`s. If a name or an
    argument order changes, C++ callers reach the base method, which raises "not
    implemented" (or mis-binds arguments): DDP and FSDP2 on a StableGroup fail at
    their first collective. A collective added to the trampoline needs a method here.
    `group_name` is a property that torch's Python code reads (functional
    collectives resolve a group by it); `getBackendName` is the trampoline's hook
    behind `ProcessGroup.name()`.
    """

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # stub lacks the Python-subclass overload

    def _run(
        self, result: Any, op: Callable[[Any], Any], untimed: bool = False, name: str = "", ins: Any = None
    ) -> dist.Work:
        """Issue `op(backend)` and return a Work that completes with `result`. `untimed`:
        gloo's timed wait cannot be used on this op's Work (see `WaitMode.THREAD`). `name`
        and `ins`: the collective and this rank's input tensors (none for point-to-point)."""
        raise NotImplementedError

    def _reduce_scatter_tensors(
        self, result: Any, outs: list[Any], ins: list[Any], opts: Any, native: Callable[[Any], Any], name: str
    ) -> dist.Work:
        """A reduce-scatter of whole tensors (`outs[i]` = this rank's chunk of the reduced
        `ins[i]`) whose Work completes with `result`; `native(backend)` issues the
        backend's own. A subclass may issue it otherwise (StableGroup on gloo:
        `gloo_reduce_scatter`)."""
        return self._run(result, native, untimed=True, name=name, ins=ins)

    # Every collective torch issues, from Python c10d or (through the pybind
    # trampoline) from C++ callers such as DDP's reducer and functional collectives.
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(
            tensors, lambda g: g.allreduce(tensors, opts or dist.AllreduceOptions()), name="allreduce", ins=tensors
        )

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._run(
            tensors,
            lambda g: g.allreduce_coalesced(tensors, opts or dist.AllreduceCoalescedOptions()),
            name="allreduce_coalesced",
            ins=tensors,
        )

    def allgather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._run(outs, lambda g: g.allgather(outs, ins, opts or AllgatherOptions()), name="allgather", ins=ins)

    def all_gather_single(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        return self._run(
            out,
            lambda g: _op(g, "all_gather_single", "_allgather_base")(out, inp, opts or AllgatherOptions()),
            name="all_gather_single",
            ins=inp,
        )

    _allgather_base = all_gather_single  # type: ignore[assignment]  # stub: other names

    def all_gather_single_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._run(
            outs,
            lambda g: _op(g, "all_gather_single_coalesced", "allgather_into_tensor_coalesced")(
                outs, ins, opts or AllgatherOptions()
            ),
            name="all_gather_single_coalesced",
            ins=ins,
        )

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # stub: other names

    def reduce_scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(
            outs,
            lambda g: g.reduce_scatter(outs, ins, opts or dist.ReduceScatterOptions()),
            untimed=True,
            name="reduce_scatter",
            ins=ins,
        )

    def reduce_scatter_single(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        return self._reduce_scatter_tensors(
            out,
            [out],
            [inp],
            opts,
            lambda g: _op(g, "reduce_scatter_single", "_reduce_scatter_base")(out, inp, opts),
            "reduce_scatter_single",
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # stub: other names

    def reduce_scatter_single_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        opts = opts or dist.ReduceScatterOptions()
        return self._reduce_scatter_tensors(
            outs,
            list(outs),
            list(ins),
            opts,
            lambda g: _op(g, "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")(outs, ins, opts),
            "reduce_scatter_single_coalesced",
        )

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # stub: other names

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(
            tensors, lambda g: g.broadcast(tensors, opts or dist.BroadcastOptions()), name="broadcast", ins=tensors
        )

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(tensors, lambda g: g.reduce(tensors, opts or dist.ReduceOptions()), name="reduce", ins=tensors)

    def all_to_all_single(self, out: Any, inp: Any, out_splits: Any, in_splits: Any, opts: Any = None) -> dist.Work:
        return self._run(
            out,
            lambda g: _op(g, "all_to_all_single", "alltoall_base")(
                out, inp, out_splits, in_splits, opts or dist.AllToAllOptions()
            ),
            name="all_to_all_single",
            ins=inp,
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # stub: other names

    def alltoall(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._run(
            outs, lambda g: g.alltoall(outs, ins, opts or dist.AllToAllOptions()), name="alltoall", ins=ins
        )

    def gather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(outs, lambda g: g.gather(outs, ins, opts or dist.GatherOptions()), name="gather", ins=ins)

    def scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._run(outs, lambda g: g.scatter(outs, ins, opts or dist.ScatterOptions()), name="scatter", ins=ins)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._run([], lambda g: g.barrier(opts or dist.BarrierOptions()), name="barrier", ins=[])

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        return self._run(tensors, lambda g: g.send(tensors, dst, tag), untimed=True)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        return self._run(tensors, lambda g: g.recv(tensors, src, tag), untimed=True)


def allgather_into(g: Any, out: torch.Tensor, inp: torch.Tensor) -> Any:
    """The backend group's all-gather of one tensor into one (torch 2.13 name, or 2.11's)."""
    return _op(g, "all_gather_single", "_allgather_base")(out, inp, AllgatherOptions())


def register_group(pg: dist.ProcessGroup, name: str, ranks: list[int], store: Store) -> None:
    """Make a subgroup known to c10d the way `new_group` would, without its job-wide barrier.

    torch 2.13: `distributed_c10d._world` (pg_map, pg_names, pg_group_ranks,
    pg_backend_config) is what dist.get_rank(group)/get_process_group_ranks and
    DeviceMesh read; `_register_process_group(name, pg)` fills the C++ registry
    that functional collectives (FSDP2) resolve group names through. If either
    changes, DeviceMesh.from_group or FSDP2's first collective on the group fails
    with "group not found"/"not part of group".
    """
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.distributed_c10d import _world

    _world.pg_map[pg] = ("resild", store)
    _world.pg_names[pg] = GroupName(name)
    _world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    _world.pg_backend_config[pg] = "cpu:resild,cuda:resild"
    _register_process_group(GroupName(name), pg)


def replace_default_group(pg: dist.ProcessGroup, name: str, store: Store) -> None:
    """Make `pg` torch's default group in place of the one `init_process_group` installed (a
    job that shrank or grew: `dist.get_rank()`, `get_world_size()` and DDP without
    `process_group=` see the new width).

    torch 2.13: `distributed_c10d._update_default_pg(pg)` sets `_world.default_pg` and the
    C++ global rank; the group is made known as `register_group` does. If they change, a
    resize fails in its recovery (tests/launcher/run/test_resize.py)."""
    from torch.distributed.distributed_c10d import _update_default_pg

    register_group(pg, name, list(range(pg.size())), store)
    _update_default_pg(pg)


def backend_group(
    backend: str, store: Store, rank: int, size: int, timeout: timedelta, gloo_host: str | None
) -> dist.ProcessGroup:
    """One epoch's backend: a c10d ProcessGroup wrapping a fresh gloo or NCCL backend.

    torch 2.13: `ProcessGroup(store, rank, size)` + `_set_default_backend` +
    `_register_backend` is how init_process_group assembles a group, without the
    global registration; gloo's options are `ProcessGroupGloo._Options` with
    `_timeout` and `_devices` (the public `Options` is Backend.Options, no
    devices); NCCL's `Options()._timeout`. If these move, forming an epoch fails
    (every recovery, and the first formation, raise in the form thread).
    """
    pg = dist.ProcessGroup(store, rank, size)
    be: Any
    if backend == "nccl":  # connects lazily, inside the first (abortable) collective
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        be = dist.ProcessGroupNCCL(store, rank, size, opts)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # stub names only `Options`
        gopts._timeout = timeout
        gopts._devices = [
            dist.ProcessGroupGloo.create_device(hostname=gloo_host)
            if gloo_host
            else dist.ProcessGroupGloo.create_default_device()
        ]
        be = dist.ProcessGroupGloo(store, rank, size, gopts)
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, be)
    return pg


def gloo_reduce_scatter(g: Any, out: Any, inp: Any, opts: Any) -> tuple[Any, Callable[[], None]]:
    """gloo's reduce-scatter of one tensor, issued as what it is: an all-reduce of a copy of
    `inp`, then this rank's chunk copied into `out`. Returns the all-reduce's Work and the
    copy, to run once that Work has completed.

    torch 2.13: `ProcessGroupGloo::reduce_scatter_tensor_coalesced` (behind
    `_reduce_scatter_base`) is exactly that, but returns a LambdaWork whose `wait(timeout)`
    ignores the timeout and which has no future; the all-reduce's Work has both. The
    result is bitwise the backend's own (tests/launcher/worker/test_stable_group.py
    checks it against gloo at 3 ranks). If gloo gains a real reduce-scatter, that test
    fails and this should go."""
    size, rank = g.size(), g.rank()
    # gloo's own checks, so a bad call fails to start (latched) as gloo's would
    if out.dtype != inp.dtype:
        raise ValueError(f"reduce_scatter: output dtype {out.dtype} != input dtype {inp.dtype}")
    same_rows = out.dim() == inp.dim() and out.shape[1:] == inp.shape[1:]
    if inp.dim() == 0 or not same_rows or out.shape[0] * size != inp.shape[0]:
        raise ValueError(f"reduce_scatter: output {tuple(out.shape)} is not 1/{size} of input {tuple(inp.shape)}")
    buf = inp.clone()
    ar = dist.AllreduceOptions()
    ar.reduceOp = opts.reduceOp
    ar.timeout = opts.timeout
    work = g.allreduce([buf], ar)
    return work, lambda: out.copy_(buf.chunk(size)[rank])


def device_mesh_from_groups(
    groups: Sequence[dist.ProcessGroup], device_type: str, mesh: torch.Tensor, names: tuple[str, ...]
) -> Any:
    """torch 2.13: `DeviceMesh.from_group` with a list of groups and an explicit mesh
    (experimental in the docs). It reads `_world` for each group's ranks (see
    register_group). If it changes, `job.hsdp_mesh()` fails; nothing else uses it."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(list(groups), device_type, mesh=mesh, mesh_dim_names=names)


def private_device_mesh(
    groups: Sequence[dist.ProcessGroup], device_type: str, mesh: torch.Tensor, names: tuple[str, ...], rank: int
) -> Any:
    """A DeviceMesh over `groups` with no default process group (a spare's warm-up, before
    it joins). torch 2.13: what `DeviceMesh.from_group` does, but through the private
    `_rank` argument, since `from_group` asks the default group for the rank. If the
    constructor changes, the warm-up is skipped (it logs why) and nothing else breaks."""
    from torch.distributed.device_mesh import DeviceMesh

    m = mesh.detach().to(dtype=torch.int, device="cpu")
    dm = DeviceMesh(device_type, m, mesh_dim_names=names, _init_backend=False, _rank=rank)
    dm._dim_group_names = [g.group_name for g in groups]
    for g in groups:
        dm._pg_registry[g.group_name] = g
    return dm


def reshape_device_mesh(mesh: Any, new: Any) -> None:
    """Make `mesh` (the job's DeviceMesh: every DTensor spec, FSDP and the loop hold this
    object) the mesh `new` is, in place: a job that shrank or grew keeps its objects.
    torch 2.13: a DeviceMesh is its instance fields (layout, rank map, group names and
    registry, rank, coordinate, cached hash); DTensor's sharding cache (per thread, keyed by
    specs that hash the mesh) is cleared. If the fields change, a resized job's first
    sharded collective fails loudly (tests/launcher/run/test_resize.py)."""
    from torch.distributed.tensor import DTensor

    mesh.__dict__.update(new.__dict__)
    mesh._hash = None
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # type: ignore[no-untyped-call]


def refresh_fsdp_meshes(model: torch.nn.Module) -> int:
    """FSDP2 reads its mesh's groups and sizes once (`FSDPMeshInfo.__post_init__`): after the
    mesh was reshaped, read them again. -> how many mesh infos were refreshed. torch 2.13:
    `_get_module_fsdp_state`, a state's `_fsdp_param_groups`, their and their params'
    `mesh_info` / `post_forward_mesh_info`."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    infos: dict[int, Any] = {}
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        for group in state._fsdp_param_groups if state is not None else ():
            owners: list[Any] = [group, *group.fsdp_params]
            for o in owners:
                for info in (o.mesh_info, o.post_forward_mesh_info):
                    if info is not None:
                        infos[id(info)] = info
    for info in infos.values():
        info.__post_init__()
    return len(infos)


def strided_shard_type() -> Any:
    """torch's _StridedShard: FSDP2's shard of a dimension tensor parallelism already split."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def submesh_dims(mesh: Any, root: Any) -> tuple[int, ...] | None:
    """Which of `root`'s dimensions `mesh` is: all of them for `root` itself or a copy of
    it, a subset for a slice (`root["shard"]`), None for a mesh not cut from `root`.
    torch 2.13: a slice knows its root (`_get_root_mesh`); DTensor compares meshes by
    value (rank map, layout, device type, names), so an equal slice is the same mesh."""
    if mesh is root:
        return tuple(range(root.ndim))
    names, root_names = getattr(mesh, "mesh_dim_names", None), root.mesh_dim_names
    if not names or not root_names or mesh._get_root_mesh() is not root or not set(names) <= set(root_names):
        return None
    dims = tuple(root_names.index(n) for n in names)
    cut = root if dims == tuple(range(root.ndim)) else root[tuple(names)]
    return dims if cut == mesh else None


_FAKE_BACKEND = "resildfake"


def fake_group(name: str, size: int) -> dist.ProcessGroup:
    """A fake group of `size` ranks named `name`, this process its rank 0 (see
    fake_default_group). torch 2.13: a FakeProcessGroup is a backend; a c10d ProcessGroup
    carries it, as in `backend_group`; DTensor's collectives find it by `group_name`."""
    from torch._C._distributed_c10d import FakeProcessGroup

    pg = dist.ProcessGroup(hash_store(), 0, size)
    be: Any = FakeProcessGroup._create_internal(0, size)
    kind = dist.ProcessGroup.BackendType.CUSTOM
    pg._set_default_backend(kind)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), kind, be)
    pg._set_group_name(GroupName(name))  # after the backends: it names them too
    return pg


@contextlib.contextmanager
def fake_default_group(world_size: int) -> Iterator[None]:
    """A fake default group of `world_size` ranks (this process rank 0; collectives return at
    once and move nothing) while the block runs, then none again. A spare's warm-up only:
    a DeviceMesh asks the default group for its rank. torch 2.13: `FakeProcessGroup`
    (what torch.testing's fake backend registers), `init_process_group` with a store, and
    `destroy_process_group()`, which also unregisters every group (a waiting spare has
    none of its own yet). If any of it changes, the warm-up is skipped."""
    from torch._C._distributed_c10d import FakeProcessGroup

    if dist.is_initialized():
        raise RuntimeError("a default process group is already set")
    if _FAKE_BACKEND.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(
            _FAKE_BACKEND,
            lambda common, opts: FakeProcessGroup._create_internal(common.group_rank, common.group_size, opts),  # type: ignore[call-arg]  # the stub lacks `options`
            extended_api=True,
            devices=["cpu", "cuda"],
        )
    dist.init_process_group(_FAKE_BACKEND, store=hash_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---- DDP's reducer -----------------------------------------------------------------
def ddp_logging_data(ddp: torch.nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    """torch 2.13: `_get_ddp_logging_data()` holds `has_rebuilt_buckets` and
    `rebuilt_per_bucket_param_indices` ("i j,k l" per bucket). If renamed, resild
    sees no rebuilt layout: a spare's DDP buckets differ from the survivors'
    (a collective size mismatch or a non-bitwise sum after recovery)."""
    return dict(ddp._get_ddp_logging_data())  # type: ignore[no-untyped-call]  # untyped in torch


def ddp_bucket_cap_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> int:
    """torch 2.13: DDP stores its bucket cap as the attribute `bucket_bytes_cap`."""
    return int(ddp.bucket_bytes_cap)


def ddp_reset_reducer(
    ddp: torch.nn.parallel.DistributedDataParallel,
    assignment: Callable[..., tuple[list[list[int]], list[int]]] | None,
) -> None:
    """A fresh reducer, as DDP's own __setstate__ builds one, its buckets chosen by `assignment`.

    torch 2.13: `_build_params_for_reducer`, `_build_debug_param_to_name_mapping`,
    `_ddp_init_helper(params, sparse, names, static_graph)` rebuild the reducer;
    the helper calls `dist._compute_bucket_assignment_by_size`, which is replaced
    while it runs (DDP reverses what it returns); static graph is set on the new
    reducer and logger with `_set_static_graph()`. If any of these change, a
    recovery with DDP fails at the reset, or the reset silently keeps the initial
    buckets (the e2e DDP test's bitwise check catches that).
    """
    params, sparse = ddp._build_params_for_reducer()  # type: ignore[no-untyped-call]  # untyped in torch
    with _bucket_assignment(assignment):
        names = ddp._build_debug_param_to_name_mapping(params)  # type: ignore[no-untyped-call]  # untyped in torch
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)  # type: ignore[no-untyped-call]  # untyped
    if ddp.static_graph:
        assert ddp.logger is not None
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()


@contextlib.contextmanager
def _bucket_assignment(fn: Callable[..., tuple[list[list[int]], list[int]]] | None) -> Iterator[None]:
    if fn is None:
        yield
        return
    orig = dist._compute_bucket_assignment_by_size  # private: not in torch.distributed.__all__
    dist._compute_bucket_assignment_by_size = fn
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = orig


# ---- GradScaler's per-optimizer record -----------------------------------------------
# torch 2.13: GradScaler keeps `_per_optimizer_states[id(optimizer)]` = {"stage": OptState,
# "found_inf_per_device": {device: tensor}}; `_refresh_per_optimizer_state` is the record
# update() starts from. resild reads the local inf/NaN verdict there and overwrites it with
# the voted one, so every rank steps or skips alike. If this changes, AMP jobs fail at their
# first commit (KeyError/AttributeError), and a recovery after unscale_ may double-unscale.
def scaler_unscaled(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Has unscale_() run on `optimizer` this step?"""
    return bool(scaler._per_optimizer_states[id(optimizer)]["stage"].name == "UNSCALED")


def scaler_found_inf(scaler: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The per-device found-inf flags unscale_() left for `optimizer` (step() reads them)."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())


def scaler_reset_stages(scaler: Any) -> None:
    """What GradScaler.update() does to the record: every optimizer back to READY."""
    if hasattr(scaler, "_per_optimizer_states"):
        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


# ---- lazy imports --------------------------------------------------------------------
def prewarm_lazy_imports() -> None:
    """torch 2.13: FSDP2's first fully_shard imports torch._dynamo (~200 modules,
    0.5 s); a spare pays it while it waits. If the module moves, this is a no-op."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # a warm-up only
        pass


# ---- DTensor ---------------------------------------------------------------------------
def dtensor_like(t: Any, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with `t`'s mesh, placements and global shape around `local`, wherever
    `local` lives. torch 2.13: `DTensor(local, spec, requires_grad=...)` with the private
    `_spec`; `DTensor.from_local` would move `local` to the mesh's device (a host copy for
    a checkpoint must stay on the host). If this changes, disk checkpoints of FSDP2 state
    fail at their first save (tests/launcher/worker/redundancy/test_disk_checkpoint.py)."""
    from torch.distributed.tensor import DTensor

    out: torch.Tensor = DTensor(local, t._spec, requires_grad=False)  # type: ignore[no-untyped-call]
    return out


# ---- DTensor's sharding cache, warmed by a spare ----------------------------------------
def _specs(x: Any) -> Iterator[Any]:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if isinstance(x, DTensorSpec):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _specs(y)


class WarmShardings:
    """The sharding propagations a spare's warm-up computed on its own meshes, served to
    the job's first queries bound to the querying mesh objects, as a fresh process binds them.

    torch 2.13: DTensor caches each op's OutputSharding in C++ (keyed by the op and its
    argument specs, meshes compared by value), and the cached specs hold the mesh object
    they were computed on: a fresh process binds every entry to the mesh object of its
    first query (FSDP2 + TP makes one mesh object per parameter; a loop may key on them).
    A miss calls the propagator's `propagate_op_sharding_non_cached`, looked up on the
    instance: `record()` keeps what the warm-up computed there; `serve()` empties both
    caches (C++ and the per-thread Python one) and answers each later miss that has a
    record with it, every warm mesh in it replaced by the query's equal mesh. Results
    computed afresh are bound too (a cached strategy may hold a warm mesh). If the hook
    goes, misses compute as in a cold process (slower, never wrong): the propagation
    count in spare/test_warmup.py fails first."""

    def __init__(self, group_prefix: str) -> None:
        from torch.distributed.tensor import DTensor

        self._sp = DTensor._op_dispatcher.sharding_propagator
        self._prefix = group_prefix  # the warm-up's own groups' names begin so
        self._records: dict[Any, Any] = {}
        self._recording = False
        self.served = 0

    def _is_warm(self, mesh: Any) -> bool:
        """A mesh on the warm-up's own (fake) groups: never one the job may hold."""
        names: list[str] = getattr(mesh, "_dim_group_names", None) or []
        return bool(names) and all(n.startswith(self._prefix) for n in names)

    def _compute(self, op_schema: Any) -> Any:
        return type(self._sp).propagate_op_sharding_non_cached(self._sp, op_schema)

    def _propagate(self, op_schema: Any) -> Any:
        if self._recording:
            out = self._compute(op_schema)
            with contextlib.suppress(TypeError):  # unhashable (symbolic shapes): not kept
                self._records.setdefault(op_schema, out)
            return out
        try:
            out = self._records.pop(op_schema, None)
        except TypeError:
            out = None
        if out is None:
            out = self._compute(op_schema)
        else:
            self.served += 1
        self._bind(out, op_schema)
        return out

    def _bind(self, out: Any, op_schema: Any) -> None:
        real = [s.mesh for s in _specs([*op_schema.args_schema, *op_schema.kwargs_schema.values()])]
        held = list(_specs(out.output_spec))
        if out.redistribute_schema is not None:
            rs = out.redistribute_schema
            held += _specs([*rs.args_schema, *rs.kwargs_schema.values()])
        for spec in held:
            if self._is_warm(spec.mesh):
                to = next((m for m in real if m == spec.mesh and not self._is_warm(m)), None)
                if to is not None:
                    spec.mesh = to

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Keep what is propagated inside (the warm-up's steps)."""
        self._sp.propagate_op_sharding_non_cached = self._propagate  # type: ignore[method-assign]
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def serve(self) -> int:
        """From now on, answer misses from the records (-> how many there are)."""
        self._recording = False
        self._sp.propagate_op_sharding_non_cached = self._propagate  # type: ignore[method-assign]
        torch._C._clear_DTensor_sharding_propagator_cache()
        self._sp.propagate_op_sharding.cache_clear()  # type: ignore[no-untyped-call]
        return len(self._records)
