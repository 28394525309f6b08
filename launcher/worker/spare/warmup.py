"""A waiting spare warms up for the job's sharded state, then serves what it computed.

While it waits for ranks, a spare reads the job's warm-up recipe from the store
(`launcher.worker.spare.recipe`: the mesh's shape and names, every optimizer
parameter's global shape, dtype and placements, the optimizer's class and
hyperparameters; rank 0 writes it at attach). It then builds a DeviceMesh equal to
the job's (same rank map, shape, names, device type) over a fake process group,
stand-in DTensor parameters and gradients of the same layouts, and runs gradient
clipping and one optimizer step on them (then one step of a small FSDP2 model on a
mesh of its own, for FSDP2's per-process first-call costs). That fills DTensor's sharding-propagation
cache with exactly the entries the spare's first real step looks up: the slow path
(fake-tensor dispatch and strategy expansion, 0.1-0.3 s here) runs now, not after
the spare has taken over. Nothing depends on which ranks it will get.

The cache's entries hold the mesh object they were computed on, and a fresh process
binds each entry to the mesh object of its first query (FSDP2 + TP makes one per
parameter: a loop may group gradients by `id(grad.device_mesh)`). So the warm mesh is
never handed to the job: what the warm-up propagated is recorded, both caches are
emptied, and each of the job's first queries is answered from the record, bound to the
querying mesh (`torch_private.WarmShardings`). The spare's objects are then those of a
fresh process (tests/launcher/worker/spare/test_warmup.py compares them). Only the shard
contents move afterwards (the replay), and on a host the optimizer state the step
created stays, touched, for the replay to receive the moments into
(`launcher.worker.transport.landing_pool`).

Isolation: the global RNG state is restored (the small model's initialisation draws
from it; the spare's random stream must not shift); the fake default group and its
groups are destroyed before the spare installs its own; any error skips the rest of
the warm-up (logged, and reported as `spare_warmed` with an `error`). A
membership arriving mid-way stops it at the next check: between two parameters' steps
on the host, else between clipping, the optimizer step and the FSDP2 step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from launcher.worker.mesh_layout import MeshLayout
from launcher.worker.spare.recipe import RECIPE_KEY, Recipe, parse
from launcher.worker.torch_private import (
    WarmShardings,
    fake_default_group,
    fake_group,
    hash_store,
    private_device_mesh,
    register_group,
    strided_shard_type,
)
from launcher.worker.transport.landing_pool import LandingPool

log = logging.getLogger("resild.warmup")

Cancelled = Callable[[], bool]
FETCH_SLICE_S = 300.0
WARM_PREFIX = "resild-warmup"  # the warm-up's fake groups' names begin so


class _Stop(Exception):
    pass


@contextlib.contextmanager
def _rng_kept(device_type: str) -> Iterator[None]:
    devices = [torch.cuda.current_device()] if device_type == "cuda" and torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def _optimizer_class(name: str) -> Callable[[list[dict[str, Any]]], torch.optim.Optimizer]:
    cls = getattr(torch.optim, name, None)
    if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer) or cls is torch.optim.Optimizer:
        raise ValueError(f"recipe: {name!r} is not an optimizer of torch.optim")
    return cls


def warm_mesh(recipe: Recipe, groups: list[Any]) -> Any:
    """A DeviceMesh equal to the job's (the recipe's rank map, shape, names, device type)
    over `groups` (one per dimension), as this process's rank 0."""
    ranks = torch.tensor(recipe.mesh_ranks, dtype=torch.int64).view(*recipe.mesh_shape)
    return private_device_mesh(groups, recipe.device_type, ranks, recipe.mesh_names, 0)


def _placement(kind: str, dim: int, split: int) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if kind == "R":
        return Replicate()
    return Shard(dim) if kind == "S" else strided_shard_type()(dim, split_factor=split)


def stand_ins(recipe: Recipe, mesh: Any, device: torch.device) -> list[torch.nn.Parameter]:
    """One DTensor parameter per recipe entry, with a zero gradient of the same layout, on
    the warm mesh or the slice of it the recipe names (cut once per set of dimensions)."""
    from torch.distributed.tensor import DTensor

    slices: dict[tuple[int, ...], Any] = {}
    whole = tuple(range(len(recipe.mesh_shape)))
    out = []
    for spec in recipe.params:
        placements = [_placement(*x) for x in spec.placements]
        dtype = spec.torch_dtype()
        dims = spec.mesh_dims(len(whole))
        if dims == whole:
            on = mesh
        else:
            on = slices.get(dims)
            if on is None:
                on = slices[dims] = mesh[tuple(recipe.mesh_names[d] for d in dims)]

        def dt(spec: Any = spec, placements: Any = placements, dtype: torch.dtype = dtype, on: Any = on) -> Any:
            local = torch.zeros(spec.local_shape(recipe.mesh_shape), dtype=dtype, device=device)
            return DTensor.from_local(
                local, on, placements, run_check=False, shape=torch.Size(spec.shape), stride=spec.stride
            )

        p = torch.nn.Parameter(dt())
        p.grad = dt()
        out.append(p)
    return out


def _keep_state(opt: torch.optim.Optimizer, landing: LandingPool | None) -> None:
    """Hand the optimizer's state (the moments of the job's shard shapes, touched by the
    step) to `landing` for the replay to receive into, instead of freeing it."""
    if landing is None:
        return
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                local = getattr(v, "_local_tensor", v)  # a DTensor's shard
                landing.add(local.detach())
    opt.state.clear()


def run_steps(
    recipe: Recipe, params: list[torch.nn.Parameter], cancelled: Cancelled, landing: LandingPool | None = None
) -> None:
    """Clip, then step the recipe's optimizer over `params`, once each: the spare's first
    real step comes after its optimizer state was loaded, and runs the same update ops
    (creating the state here propagates a few more, cheap ones).

    The step is the warm-up's longest part (0.1-0.3 s here), and a spare given ranks in the
    middle of it finishes it first. On the host, torch.optim's default (single-tensor)
    implementations propagate each parameter's ops on their own, so there each parameter
    is stepped by an optimizer of its own, and a membership stops the warm-up between two
    parameters. Foreach and fused implementations (a GPU's default, or asked for) take the
    whole list in each op, which is what DTensor's cache keys: those step all at once.
    On the host the state the steps create is kept in `landing` (launcher.worker.transport.landing_pool)."""
    cls = _optimizer_class(recipe.optimizer)
    if cancelled():
        raise _Stop
    by_mesh: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:  # one norm per mesh: torch's clipping takes one mesh at a time
        dt: Any = p  # a DTensor parameter
        by_mesh.setdefault(dt.device_mesh, []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grad_norm_(group, 1.0)
    whole = params[0].device.type != "cpu" if params else True
    whole = whole or any(hp.get("foreach") or hp.get("fused") for hp, _ in recipe.groups)
    if whole:
        if cancelled():
            raise _Stop
        opt = cls([{**hp, "params": [params[i] for i in idx]} for hp, idx in recipe.groups])
        opt.step()
        _keep_state(opt, landing)
        return
    for hp, idx in recipe.groups:
        for i in idx:
            if cancelled():
                raise _Stop
            opt = cls([{**hp, "params": [params[i]]}])
            opt.step()
            _keep_state(opt, landing)


def dim_ranks(recipe: Recipe, dim: int) -> list[int]:
    """The ranks of rank 0's group along `dim` of the recipe's mesh."""
    ranks = torch.tensor(recipe.mesh_ranks, dtype=torch.int64).view(*recipe.mesh_shape)
    where: list[Any] = [int(c) for c in (ranks == 0).nonzero()[0]]
    where[dim] = slice(None)
    return [int(r) for r in ranks[tuple(where)].tolist()]


def _fake_groups(recipe: Recipe, prefix: str) -> list[Any]:
    groups = []
    for dim, n in enumerate(recipe.mesh_shape):
        label = f"{prefix}-{dim}"
        g = fake_group(label, n)
        register_group(g, label, dim_ranks(recipe, dim), hash_store())
        groups.append(g)
    return groups


def fsdp_steps(recipe: Recipe, device: torch.device, cancelled: Cancelled) -> None:
    """FSDP2's per-process first-call costs (fully_shard, lazy init, its custom ops, the
    first forward and backward): one step of a small model sharded over a mesh of the
    recipe's shape under names of its own. No DeviceMesh equal to it is ever the job's,
    so nothing computed on it is ever looked up for the job's tensors."""
    from torch.distributed.fsdp import fully_shard

    names = tuple(f"resild-warmup-{n}" for n in recipe.mesh_names)
    ranks = torch.tensor(recipe.mesh_ranks, dtype=torch.int64).view(*recipe.mesh_shape)
    mesh = private_device_mesh(_fake_groups(recipe, f"{WARM_PREFIX}-fsdp"), device.type, ranks, names, 0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if cancelled():
        raise _Stop
    model(torch.zeros(4, 16, device=device)).sum().backward()


Prepare = Callable[[Any], None]


def run_prepare(recipe: Recipe, device: torch.device, prepare: Prepare) -> None:
    """The script's own preparation (`launcher.init(prepare=fn)`): `fn(mesh)` builds, compiles
    and runs its model on a mesh equal to the job's over stand-in groups, so that torch.compile's
    in-process caches (dynamo's code cache, keyed by code object and guards, not by module
    instance) hold the graphs the spare's real model will run after the takeover."""
    names = recipe.mesh_names
    ranks = torch.tensor(recipe.mesh_ranks, dtype=torch.int64).view(*recipe.mesh_shape)
    mesh = private_device_mesh(_fake_groups(recipe, f"{WARM_PREFIX}-prepare"), device.type, ranks, names, 0)
    dtype = torch.get_default_dtype()
    try:
        prepare(mesh)
    finally:
        torch.set_default_dtype(dtype)


def warm_up(
    recipe: Recipe,
    device: torch.device,
    shardings: WarmShardings,
    cancelled: Cancelled = lambda: False,
    landing: LandingPool | None = None,
    prepare: Prepare | None = None,
) -> str | None:
    """Run the warm-up. `shardings` records what the steps propagate on the warm mesh and
    serves it afterwards, even if what follows fails or stops. `landing` (host only) keeps
    the optimizer state the step created, for the replay. `prepare`: the script's own
    preparation, run last (never stopped: it is the script's code) -> its error, if any:
    the spare then compiles after the takeover."""
    failed: str | None = None
    if recipe.device_type != device.type:
        raise ValueError(f"recipe for {recipe.device_type}, this spare runs on {device.type}")
    try:
        with _rng_kept(device.type), fake_default_group(recipe.world_size):
            mesh = warm_mesh(recipe, _fake_groups(recipe, WARM_PREFIX))
            try:
                with shardings.record():
                    run_steps(recipe, stand_ins(recipe, mesh, device), cancelled, landing)
                fsdp_steps(recipe, device, cancelled)
            except _Stop:
                log.info("spare warm-up stopped: ranks arrived")
            if prepare is not None and not cancelled():  # given ranks: the real step compiles, as costly
                try:
                    run_prepare(recipe, device, prepare)
                except Exception as e:  # the script's code: whatever it raises, the spare compiles later
                    failed = f"{type(e).__name__}: {e}"
    finally:
        shardings.serve()
    return failed


class SpareWarmup:
    """A spare's warm-up, driven from its wait for ranks: a thread waits for the recipe
    in the store (one parked request, no polling); the spare's own thread runs the
    warm-up when `ready()` (the fake default group must be gone before it joins)."""

    def __init__(
        self, store: Any, device: torch.device, on_done: Callable[[float, str | None], None] | None = None
    ) -> None:
        self.store, self.device, self.on_done = store, device, on_done
        self._text: bytes | None = None
        self._recipe: Recipe | None = None  # parsed by the warm-up
        self.started = False
        self._stopped = False
        self._done = False
        self.shardings: WarmShardings | None = None  # what the warm-up propagated, served to the job
        self.seconds: float | None = None
        self.error: str | None = None
        self.landing = LandingPool()  # the moments the warm-up's step touched, for the replay (host only)
        self.prepare: Prepare | None = None  # the script's launcher.init(prepare=fn)
        self.prepare_error: str | None = None

    def start(self) -> None:
        """Fetch the recipe (once; later calls do nothing)."""
        if not self.started:
            self.started = True
            threading.Thread(target=self._fetch, name="resild-warmup-recipe", daemon=True).start()

    def _fetch(self) -> None:
        """Wait for the recipe in slices (a parked request at the controller each; a slice
        lost with a controller fail-over is asked again), then read it."""
        from datetime import timedelta

        while self._text is None and not self._stopped:
            try:
                self.store.wait([RECIPE_KEY], timedelta(seconds=FETCH_SLICE_S))
                if not self._stopped:  # given ranks meanwhile: the recipe is of no use
                    self._text = self.store.get(RECIPE_KEY)
            except Exception as e:  # not published yet, or the link is gone: ask again later
                self.error = f"no recipe: {e}"
                time.sleep(1.0)
        self.error = None

    def stop(self) -> None:
        """This worker has ranks: fetch nothing more."""
        self._stopped = True

    def ready(self) -> bool:
        """A recipe arrived and the warm-up has not run yet."""
        return self._text is not None and not self._done

    def run(self, cancelled: Cancelled) -> None:
        """Warm up once (in the spare's main thread, while it waits)."""
        if self._done or self._text is None:
            return
        self._done = True
        t0 = time.monotonic()
        try:
            self._recipe = parse(self._text)
            self.shardings = WarmShardings(WARM_PREFIX)
            self.prepare_error = warm_up(
                self._recipe, self.device, self.shardings, cancelled, self.landing, self.prepare
            )
        except Exception as e:  # an optimisation only: the first step pays what this did not
            self.error = f"{type(e).__name__}: {e}"
            log.info("spare warm-up skipped: %s", self.error)
        self.seconds = time.monotonic() - t0
        if self.on_done is not None:
            self.on_done(self.seconds, self.error)

    def layout(self, world_size: int) -> MeshLayout | None:
        """The job's mesh as the recipe describes it, if this spare holds a recipe and the
        mesh is one `job.mesh()` builds for `world_size` ranks (row-major), else None."""
        if self._text is None:
            return None
        try:
            r = self._recipe or parse(self._text)
            layout = MeshLayout.build(world_size, r.mesh_shape, r.mesh_names)
        except (ValueError, KeyError, TypeError):  # MeshError is a ValueError
            return None
        return layout if r.mesh_ranks == tuple(range(world_size)) else None
