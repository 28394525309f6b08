"""The library inside the training process: `launcher.init` and the `Job` facade.

A plain data-parallel loop needs four lines (examples/train.py):

    job = launcher.init(model, optimizer, scheduler=sched)
    for step in job.steps(total):
        ...forward/backward...
        job.commit()

Sharded and wrapped models (FSDP2/HSDP, DDP) join first, build on the job's
stable group or mesh, then attach (examples/train_hsdp.py):

    job = launcher.init()                      # a spare waits here
    mesh = job.hsdp_mesh(shard_size=4)         # DeviceMesh over resild's groups
    fully_shard(model, mesh=mesh); opt = AdamW(model.parameters())
    job.attach(model, opt, scheduler=sched, scaler=scaler, extra=loader)
    for step in job.steps(total):
        ...forward/backward (hooks sync gradients)...
        job.sync()                             # optional: plain loops all-reduce here
        scaler.unscale_(opt); clip_grad_norm_(model.parameters(), 1.0)
        job.commit()                           # vote; optimizer/scaler/scheduler step

The optimizer steps only if every rank of the epoch completed this step's
gradient sync (the commit vote). `Job` is a facade over the parts:
`links.controller` (the controller link), `stable_group` (the stable process
group and backend factory), `recovery` (the sequence), `recovery_driver` (the loop
that runs it until an epoch completes), `resize` (shrink and grow), `step_state` and
`commit` (the step's phases, the commit protocol and its after-commit hooks),
`sources` (where a lost rank's state is restored from), `transport` (the replay),
`train_state` (what is replayed), `redundancy` (peer-memory snapshots and rollback,
resild's disk checkpoints, replicas' fingerprints), `mesh_layout`
(any mesh), `spare.warmup` and `spare.recipe` (a waiting spare's warm-up for the
job's sharded state); private torch APIs in `torch_private`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

import resild.wire.env as resild_env
from launcher.worker.collective_check import CollectiveCheck
from launcher.worker.commit import CommitProtocol
from launcher.worker.ddp import find_ddp
from launcher.worker.links.agent import AgentLink, agent_endpoint
from launcher.worker.links.controller import ControlLink, keys_from_env
from launcher.worker.links.store import LinkStore
from launcher.worker.mesh_layout import MeshError, MeshLayout
from launcher.worker.pace import Pace
from launcher.worker.recovery import RecoverySequence, Reformed
from launcher.worker.recovery_driver import RecoveryDriver
from launcher.worker.redundancy.coordinator import Redundancy, RedundancyError
from launcher.worker.replica_map import ReplicaMap
from launcher.worker.resize import Resizer
from launcher.worker.sources.base import StateSource
from launcher.worker.sources.chain import build as build_sources
from launcher.worker.sources.context import SourceContext
from launcher.worker.spare.recipe import RECIPE_KEY
from launcher.worker.spare.recipe import describe as describe_recipe
from launcher.worker.spare.waiting import compiled_graphs, wait_for_ranks, warmup_plan
from launcher.worker.spare.warmup import SpareWarmup
from launcher.worker.stable_group import (
    GroupFactory,
    Interrupts,
    StableGroup,
    exchange_rows,
    install_default,
    register,
)
from launcher.worker.step_state import StepState
from launcher.worker.torch_private import (
    device_mesh_from_groups,
    gloo_batched_reads,
    hash_store,
    prewarm_lazy_imports,
    refresh_fsdp_meshes,
    replace_default_group,
    reshape_device_mesh,
)
from launcher.worker.train_state import TrainState
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import Mac
from resild.events.schema import EventName
from resild.membership import Membership
from resild.wire.protocol import MsgType
from resild.wire.settings import WorkerRedundancy, WorkerTimeouts

log = logging.getLogger("resild.runtime")


Replicas = Callable[[int], ReplicaMap]


class ResilienceError(RuntimeError):
    pass


class Job:
    """Handle returned by `launcher.init`. `rank`, `world_size`, `step`, `epoch` are current values."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        extra: Any = None,
        replicas: Replicas | None = None,
        *,
        scaler: Any = None,
        prepare: Callable[[Any], None] | None = None,
    ) -> None:
        self.rank, self.world_size, self.epoch = 0, 1, 0
        self._prepare = prepare  # a spare runs it while it waits (launcher.worker.spare.warmup.run_prepare)
        self._graphs_at_takeover: int | None = None  # torch.compile graphs this process had when it took over
        self.steps_state = StepState()  # the step and its phase in the commit protocol
        self.state: TrainState | None = None
        self._protocol: CommitProtocol | None = None  # from attach on
        self._replicas: Replicas | None = replicas
        self._mesh_replicas: Replicas | None = None
        self._mesh: Any = None
        self._layout: MeshLayout | None = None
        self._warmup: SpareWarmup | None = None  # a spare's warm-up for the job's sharded state
        self._took_over = False  # a spare given a failed node's ranks (not in the job's first epoch)
        self._stopping = False  # this rank asked the controller to stop the job (FATAL)
        self.intr = Interrupts()
        # What the job's groups issue, compared between ranks at every vote, checked one by one
        # after a recovery (launcher.worker.collective_check)
        self.checks = CollectiveCheck(
            1,
            False,
            lambda: self.steps_state.step,
            self._fatal,
            os.environ.get(resild_env.CHECK_COLLECTIVES.name, resild_env.CHECK_COLLECTIVES.default) == "1",
        )
        self._resizer = Resizer()  # shrink and grow (--min-replicas)
        self.cfg: dict[str, Any] = {}
        self.timeouts = WorkerTimeouts.from_welcome({})  # alone (no controller): the defaults
        self.redundancy_cfg = WorkerRedundancy.from_welcome({})
        self.redundancy: Redundancy | None = None  # snapshots, disk checkpoints, fingerprints (at attach)
        self._sources: list[StateSource] = []  # where a lost rank's state is restored from (at attach)
        self._per_node = 1  # ranks per node (snapshot placement)
        self.link: ControlLink | None = None
        self._agent: AgentLink | None = None
        controller = os.environ.get(resild_env.CONTROLLER.name)
        self.solo = controller is None
        self.pace = Pace()  # this rank's own compute per step, in its commit reports (stragglers)
        self._total = 0  # the steps job.steps() was asked for
        self.node = os.environ.get(resild_env.NODE.name, resild_env.NODE.default)
        self.local_rank = int(os.environ.get(resild_env.LOCAL_RANK.name, resild_env.LOCAL_RANK.default))
        if controller is None:
            self._init_solo()
        else:
            self._init_controlled(controller)
        if model is not None:
            if optimizer is None:
                raise ResilienceError("launcher.init(model, optimizer, ...): the optimizer is required with a model")
            self.attach(model, optimizer, scheduler, scaler=scaler, extra=extra, replicas=replicas)

    @property
    def step(self) -> int:
        """The step to compute next (= steps committed)."""
        return self.steps_state.step

    # ---- joining ----------------------------------------------------------------------
    def _init_solo(self) -> None:
        self.backend = "gloo"
        self.device = torch.device("cpu")
        store = hash_store()
        self.rec = RecoverySequence(self.intr, GroupFactory("gloo", lambda: store, 60.0), self.device, 0.0)
        self._driver = self._recovery_driver()
        self._store = store
        self.rank, self.world_size, self.epoch = 0, 1, 1
        self._make_world(store)
        self.rec.form(1, [self.group])

    def _init_controlled(self, controller: str) -> None:
        # Before any gloo group forms: its addresses in one request per group, not 2W + 1.
        gloo_batched_reads(os.environ)
        link = self.link = ControlLink(
            controller,
            keys_from_env(),
            self.node,
            self.local_rank,
            self.intr,
            lambda: (self.rank, self.epoch, self.step),
        ).start()
        link.send(MsgType.REGISTER_WORKER, local_rank=self.local_rank, pid=os.getpid())
        if not link.wait(lambda: link.welcome is not None, 120.0):
            raise ResilienceError(f"no welcome from the controller within 120s ({controller})")
        self.cfg = dict(link.welcome or {})
        self.timeouts = WorkerTimeouts.from_welcome(self.cfg)  # the job's, from the controller
        self.redundancy_cfg = WorkerRedundancy.from_welcome(self.cfg)
        self.pace.enabled = self.redundancy_cfg.pace  # --stragglers off: no pace measured
        self.backend = os.environ.get(resild_env.BACKEND.name) or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout_s = self.timeouts.collective_timeout_s
        # One store for the job, kept referenced here (torch calls it from C++): its keys
        # live with the leading controller, reached over the authenticated link.
        store_timeout_s = float(self.cfg.get("store_timeout_s", timeout_s))
        self._store = LinkStore(link.request, store_timeout_s)
        self._node_store = LinkStore(link.request, store_timeout_s, node_local=True)
        factory = GroupFactory(
            self.backend,
            lambda: self._store,
            timeout_s,
            os.environ.get(resild_env.GLOO_HOST.name),
            local_store_client=lambda: self._node_store,
            node_ranks=self._node_ranks,
        )
        self.rec = RecoverySequence(self.intr, factory, self.device, timeout_s + 5.0)
        self.rec.mac = Mac.from_hex(self.cfg.get("data_key"))  # state on the wire: authenticated
        self._driver = self._recovery_driver()
        self._install_excepthook()
        ep = agent_endpoint()
        self._agent = AgentLink(ep, f"{self.node}/rank{self.local_rank}", lambda: self.step).start() if ep else None
        # A spare waits here, warm (torch imported, CUDA context up, and once the job has
        # described its sharded state, DTensor's caches filled for it), until it is given ranks.
        if not link.wait(lambda: link.pending is not None or link.shutdown is not None, 0.5):
            prewarm_lazy_imports()
        warm, fetch_after_s = warmup_plan(self.cfg.get("role"), os.environ)
        if warm:
            self._warmup = SpareWarmup(self._store, self.device, self._report_warmup)
            if os.environ.get(resild_env.SPARE_PREPARE.name, resild_env.SPARE_PREPARE.default) != "0":
                self._warmup.prepare = self._prepare
        m, self.rank = wait_for_ranks(
            link,
            self.node,
            self.local_rank,
            lambda: self._check_shutdown(waiting_spare=True),
            self._warmup,
            fetch_after_s=fetch_after_s,
        )
        self.world_size, self.epoch = m.world_size, m.epoch
        full = self.cfg.get("full_world")
        self._resizer.full_world_size = full if isinstance(full, int) and full >= self.world_size else self.world_size
        self._per_node = len(m.node_ranks.get(self.node, ())) or 1
        self._took_over = self.checks.fresh = self.epoch > 1
        if self._took_over:  # a spare taking over: building the model may take a while, and that is no hang
            self._graphs_at_takeover = compiled_graphs()
            self._progress("join")
        self._make_world(self._store)
        self._driver.form_until_stable(only=[self.group, *self._recipe_groups()])

    def _recovery_driver(self) -> RecoveryDriver:
        """The recovery loop, once this process has its recovery sequence (and link)."""
        return RecoveryDriver(
            self,
            self.rec,
            self.intr,
            self.link,
            self.timeouts,
            self.steps_state,
            self.checks,
            self._resizer,
            self.node,
            self.local_rank,
            ResilienceError,
        )

    def _checked(self, g: StableGroup) -> StableGroup:
        """One of the job's groups: its collectives are described to the check. The world
        group also carries the check's own exchange."""
        g.check = self.checks
        self.checks.name_group(g.label)
        if g.store_key == "world":
            self.checks.world_size = len(g.ranks)
            self.checks.exchange = exchange_rows(g, self.device)
        return g

    def _node_ranks(self) -> frozenset[int]:
        """This node's ranks in the epoch taken last (the one being formed)."""
        m = self.link.current if self.link is not None else None
        return frozenset(m.node_ranks.get(self.node, ())) if m is not None else frozenset()

    def _make_world(self, store: Any) -> None:
        self.group: StableGroup = self._checked(
            StableGroup("world", list(range(self.world_size)), self.rank, self.intr)
        )
        self.rec.groups["world"] = self.group
        install_default(self.group, store)

    # ---- shrink and grow (launcher.worker.resize) ---------------------------------------
    @property
    def full_world_size(self) -> int:
        """The job's width with every node it started with."""
        return self._resizer.full_world_size

    @property
    def replicas(self) -> int:
        """Replicas of the training state in this epoch: every rank of a data-parallel job,
        the size of the `replicate` dimension of a mesh."""
        return self.world_size // Resizer.replica_ranks(self._layout)

    def on_resize(self, callback: Callable[[int, int], None]) -> None:
        """`callback(old_world_size, new_world_size)` runs on every rank that lived through a
        resize (--min-replicas: a shrink when no spare was left, a grow when one came), after
        the state is agreed and before the next step: rebuild what depends on the width (a
        sampler, a learning-rate scale). A newcomer starts at the new width and is not called."""
        self._resizer.callbacks.append(callback)

    def data_shards(self) -> list[int]:
        """The data-parallel shards this rank computes to keep the job's global batch: its
        rank at full width; when shrunk, the shards of the missing ranks spread round-robin.
        Accumulate over them with each loss scaled by `shard_weight` (the gradient average
        over the ranks then equals the full-width one, up to summation order)."""
        return self._resizer.data_shards(self.rank, self.world_size)

    @property
    def shard_weight(self) -> float:
        """world_size / full_world_size: a shard's loss scale under `data_shards()`."""
        return self._resizer.shard_weight(self.world_size)

    def _cannot_resize(self) -> str | None:
        """Why this job cannot change width by whole nodes (None: it can)."""
        return Resizer.refusal(self._replicas is not None, self._layout, self._per_node)

    def _resize(self, rank: int, m: Membership) -> None:
        """A new width (after `retire`): new world and host groups for it, formed with the
        epoch's; torch's default group, DDP's group, the commit protocol, redundancy and the
        restore sources follow. c10d names stay unique in this process; the ranks meet under
        the plain names (`store_key`), as a newcomer names them."""
        assert self.state is not None
        self._resizer.widths += 1
        self.rank, self.world_size = rank, m.world_size
        self._per_node = len(m.node_ranks.get(self.node, ())) or 1
        if self.redundancy is not None:
            self.redundancy.close()
        self.rec.groups.clear()  # the old width's groups: retired, never formed again
        world = StableGroup(self._resizer.name("world"), list(range(self.world_size)), rank, self.intr, "world")
        world.allow = True
        self._checked(world)
        self.group = self.rec.groups["world"] = world
        replace_default_group(world, world.label, self._store)
        if self._layout is not None and self._mesh is not None:
            # the same mesh object, reshaped: DTensors, FSDP and the loop keep what they hold
            layout = self._layout.resized(self.world_size)
            groups, _ = self._mesh_groups(layout)  # formed with the epoch's
            for g in groups:
                g.allow = True
            self._set_layout(layout)
            reshape_device_mesh(self._mesh, self._device_mesh(layout, groups, self._mesh.device_type))
            refresh_fsdp_meshes(self.state.model)
        ddp = find_ddp(self.state.model)
        if ddp is not None:
            ddp.process_group = world  # its reducer is rebuilt on this group as the recovery ends
        self._protocol = CommitProtocol(self.steps_state, self.state, world, self.intr, self._abandoned, self.checks)
        self._resizer.forming_deferred = True
        try:
            self._setup_redundancy()
        finally:
            self._resizer.forming_deferred = False

    def mesh(
        self, shape: tuple[int, ...] | list[int], names: tuple[str, ...] | list[str], device_type: str | None = None
    ) -> Any:
        """A DeviceMesh of any shape over resild's stable groups, ranks laid out row-major
        as `init_device_mesh` does; one size may be -1. For example `("shard",)` (plain
        FSDP2), `("shard", "tp")` (FSDP2 + tensor parallel), `("replicate", "shard", "tp")`.
        The replica map follows from the names: ranks equal on every coordinate but
        `replicate` hold the same state; with none, recovery rolls back to snapshots."""
        if self._mesh is not None:
            raise ResilienceError("job.mesh(): this job already has a mesh (build it once, before attach)")
        if self.state is not None:
            raise ResilienceError("job.mesh(): build the mesh before job.attach()")
        try:
            layout = MeshLayout.build(self.world_size, shape, names)
        except MeshError as e:
            raise ResilienceError(str(e)) from None
        groups, fresh = self._mesh_groups(layout)
        if fresh:
            self._driver.form_until_stable(only=fresh)
        self._set_layout(layout)
        mesh = self._device_mesh(layout, groups, device_type or self.device.type)
        self._mesh = mesh
        return self._mesh

    def _set_layout(self, layout: MeshLayout) -> None:
        self._layout = layout
        self._mesh_replicas = lambda w: layout.replicas()

    @staticmethod
    def _device_mesh(layout: MeshLayout, groups: list[StableGroup], device_type: str) -> Any:
        mesh_ranks = torch.arange(layout.world_size).view(*layout.shape)
        return device_mesh_from_groups(groups, device_type, mesh_ranks, layout.names)

    def _mesh_groups(self, layout: MeshLayout) -> tuple[list[StableGroup], list[StableGroup]]:
        """-> (this rank's group along each dimension of `layout`, those of them made now,
        still to be formed)."""
        groups: list[StableGroup] = []
        fresh: list[StableGroup] = []
        for dim in range(len(layout.shape)):
            label, ranks = layout.group(dim, self.rank)
            g = self.rec.groups.get(label)
            if g is None:
                name = self._resizer.name(label)
                g = self.rec.groups[label] = self._checked(StableGroup(name, ranks, self.rank, self.intr, label))
                g.allow = self.group.allow
                register(g, self._store)
                fresh.append(g)
            groups.append(g)
        return groups, fresh

    def _recipe_groups(self) -> list[StableGroup]:
        """A spare taking over that holds the job's warm-up recipe knows the job's mesh before
        the user's code asks for it: its groups are made now, to be formed with the world
        group at once (as the survivors form theirs), not one after the other; `mesh()`
        then finds them. The recipe is the survivors' own mesh, so they hold every one."""
        layout = self._warmup.layout(self.world_size) if self._warmup is not None and self._took_over else None
        return self._mesh_groups(layout)[1] if layout is not None else []

    def hsdp_mesh(self, shard_size: int, device_type: str | None = None) -> Any:
        """Shorthand for `mesh((-1, shard_size), ("replicate", "shard"))`: shard inside
        groups of `shard_size` consecutive ranks, replicate across them."""
        S, W = int(shard_size), self.world_size
        if S <= 0 or W % S:
            raise ResilienceError(f"hsdp_mesh: world size {W} is not a multiple of shard_size {shard_size}")
        return self.mesh((W // S, S), ("replicate", "shard"), device_type)

    def attach(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        scaler: Any = None,
        extra: Any = None,
        replicas: Replicas | None = None,
    ) -> Job:
        """Hand resild the training state. On a spare this is where the failed rank's
        state arrives from a replica; at the job's start the ranks agree on step 0."""
        if self.state is not None:
            raise ResilienceError("job.attach() was already called")
        self.state = TrainState(model, optimizer, scheduler, scaler, extra, self.device)
        self._protocol = CommitProtocol(
            self.steps_state, self.state, self.group, self.intr, self._abandoned, self.checks
        )
        if replicas is not None:
            self._replicas = replicas
        self.steps_state.committed_aux = self.state.capture_aux()
        for g in self.rec.groups.values():
            g.allow = True
        min_replicas = self.redundancy_cfg.min_replicas
        why = self._cannot_resize() if min_replicas > 0 else None
        if why is not None and not self.solo:  # the user's setting: one line, no traceback
            refusal = f"--min-replicas {min_replicas}: this job cannot shrink: {why}; run it without --min-replicas"
            sys.stderr.write(f"resild: {refusal}\n")  # before the job is stopped around it
            try:
                self._fatal(refusal)
            except ResilienceError:
                raise SystemExit(2) from None
        if not self.solo:
            self._setup_redundancy()
            try:
                self._driver.join()
            except Reformed:
                self._driver.recover()
            if self.rank == 0 and not self._took_over:  # a spare that took rank 0 over finds it there
                self._publish_warmup_recipe()
            if self.rank == 0 and min_replicas > 0:  # the controller counts replicas in these units
                self._event(EventName.REPLICA_LAYOUT, unit=Resizer.replica_ranks(self._layout), replicas=self.replicas)
        return self

    def _publish_warmup_recipe(self) -> None:
        """Describe the sharded state for spares to warm up on (launcher.worker.spare.recipe);
        nothing for a model that is not sharded on the job's mesh."""
        assert self.state is not None
        try:
            text = describe_recipe(self.state.optimizer, self._mesh)
            if text is not None:
                self._store.set(RECIPE_KEY, text)
        except Exception as e:  # spares then just do not warm up
            log.info("no warm-up recipe for spares: %s", e)

    def _report_warmup(self, seconds: float, error: str | None) -> None:
        """A waiting spare's warm-up finished (it has no rank yet)."""
        fields: dict[str, Any] = {"rank": None, "local_rank": self.local_rank}  # the controller adds the node
        fields["seconds"] = round(seconds, 4)
        landing = self._landing()
        if landing is not None:
            fields["landing_bytes"] = landing.nbytes  # kept for the replay (launcher.worker.transport.landing_pool)
        if error is not None:
            fields["error"] = error[:300]
        if self._prepare is not None and self._warmup is not None:
            fields["prepared"] = self._warmup.prepare is not None and self._warmup.prepare_error is None
            if self._warmup.prepare_error is not None:
                fields["prepare_error"] = self._warmup.prepare_error[:300]
                sys.stderr.write(
                    f"resild: a spare's launcher.init(prepare=...) failed ({self._warmup.prepare_error[:300]}): "
                    "it will compile after the takeover\n"
                )
        self._event(EventName.SPARE_WARMED, **fields)

    def _report_compiled(self, before: int) -> None:
        """A spare's first step after taking over has committed: how many torch.compile
        graphs it had to compile in it (0: its preparation, or no compiling, covered them)."""
        self._graphs_at_takeover = None
        graphs = compiled_graphs() - before
        if graphs > 0 and self.local_rank == 0:
            why = "no launcher.init(prepare=...)" if self._prepare is None else "its preparation did not cover them"
            sys.stderr.write(f"resild: rank {self.rank} compiled {graphs} graph(s) after taking over ({why})\n")
        self._event(EventName.SPARE_COMPILED, graphs=graphs, prepared=self._prepare is not None)

    def _setup_redundancy(self) -> None:
        assert self.state is not None and self._protocol is not None
        red = self.redundancy = Redundancy(
            self.redundancy_cfg,
            self.rank,
            self.world_size,
            self._per_node,
            self.device,
            self.rec,
            self._event,
            self._fatal,
        )
        try:
            red.setup(self.state, self.steps_state, self._protocol, self._replica_map, self.group, self._host_group)
        except RedundancyError as e:
            self._fatal(str(e))  # every rank computes the same: stop the job, do not burn spares on it
        self._sources = build_sources(
            SourceContext(
                self.rank,
                self.world_size,
                self.rec,
                self._protocol,
                self._replica_map,
                int(self.cfg.get("replay_sources", 2)),
                red,
                self._event,
                self._fatal,
            )
        )

    def _host_group(self, label: str, timeout_s: float | None = None) -> StableGroup:
        """A gloo group of every rank for host-memory traffic (snapshots, checkpoints), formed
        now. `timeout_s`: its collectives' own timeout (None: the job's)."""
        g = StableGroup(self._resizer.name(label), list(range(self.world_size)), self.rank, Interrupts(), label)
        g.backend = "gloo"  # host memory, whatever the training backend
        g.timeout_s = timeout_s
        g.allow = True
        register(g, self._store)
        self.rec.groups[g.label] = g
        if not self._resizer.forming_deferred:
            self._driver.form_until_stable(only=[g])
        return g

    # ---- messages and failures -----------------------------------------------------
    def _install_excepthook(self) -> None:
        # Interpreter teardown with torch loaded takes ~1-2 s; report the failure first.
        prev = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            if self._stopping:  # this rank stopped the job (FATAL) with a line the controller says, once;
                return  # what is raised on the way out (through torch's C++ callers: any type) adds nothing
            try:
                if self.link is not None:
                    self.link.send(
                        MsgType.FAILED,
                        local_rank=self.local_rank,
                        pid=os.getpid(),
                        error=f"{tp.__name__}: {value}"[:1000],
                    )
                    self.link.close(flush_s=1.0)
            except Exception:
                pass  # best effort; the exit is seen by the node process anyway
            finally:
                if issubclass(tp, ResilienceError):  # resild's own error: one line, no traceback
                    sys.stderr.write(f"resild: rank {self.rank}: {value}\n")
                else:
                    prev(tp, value, tb)

        sys.excepthook = hook

    def _check_shutdown(self, waiting_spare: bool = False) -> None:
        s = self.link.shutdown if self.link is not None else None
        if s is None:
            return
        if int(s.get("exit_code", 1)) != 0:
            # One write (SystemExit's message would be two: text, then newline): every rank
            # stops at once, on the stderr pipe it shares with resil-run's own last line.
            sys.stderr.write(f"resild: job stopped by the controller: {s.get('reason')}\n")
            sys.stderr.flush()
            raise SystemExit(1)
        if waiting_spare:
            raise SystemExit(0)  # the job is complete and this spare was never needed

    def _event(self, name: str, **fields: Any) -> None:
        if self.link is not None:
            self.link.send(
                MsgType.EVENT,
                name=name,
                fields={"rank": self.rank, "epoch": self.epoch, "t_mono": time.monotonic(), **fields},
            )

    def _progress(self, state: str, **extra: Any) -> None:
        if self.link is not None:
            self.link.send(MsgType.PROGRESS, rank=self.rank, epoch=self.epoch, step=self.step, state=state, **extra)

    # ---- what a recovery asks of the job (the loop: launcher.worker.recovery_driver) ----
    def _landing(self) -> LandingPool | None:
        """What a spare's warm-up touched for its state's tensors with no live home."""
        return self._warmup.landing if self._warmup is not None else None

    def _fatal(self, why: str) -> NoReturn:
        """Every rank computes the same plan, so every rank lands here: stop the job."""
        self._stopping = True
        if self.link is not None:
            self.link.send(MsgType.FATAL, error=why)
            self.link.close(flush_s=1.0)
        raise ResilienceError(why) from None

    def _floor(self) -> int:
        """The newest step the controller knew committed when it decided this epoch: below
        it, every replica of the state is gone. It comes with the epoch's membership (from
        the authenticated controller), never from the store, which anyone can write."""
        if self.solo or self.epoch <= 1 or self.link is None or self.link.current is None:
            return 0
        return self.link.current.committed

    def _replica_map(self) -> ReplicaMap:
        make = self._replicas or self._mesh_replicas or ReplicaMap.data_parallel
        rm = make(self.world_size)
        rm.validate(self.world_size)
        return rm

    # ---- the training loop ------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step to compute until `total` steps are committed; after a
        recovery the next step yielded is the agreed committed step."""
        if self.state is None:
            raise ResilienceError("call job.attach(model, optimizer, ...) before job.steps()")
        st = self.steps_state
        while True:
            self._total = total
            while st.step < total:
                st.open_step()
                self.pace.opened()
                yield st.step
                if st.close_step() == 0:
                    raise ResilienceError("call job.commit() once per step inside `for step in job.steps(...)`")
            if self.solo or self._finish():
                return

    def _finish(self) -> bool:
        """Report done, then stay available as a replica until the controller
        says the whole job is done (a late failure may still need our state)."""
        link = self.link
        assert link is not None
        if self.redundancy is not None:
            if self.redundancy.writing():
                self._progress("checkpoint")  # waiting (bounded) for its last disk checkpoint: not hung
            warning = self.redundancy.before_done(self.timeouts.collective_timeout_s)
            if warning:
                log.warning(warning)
        link.send(MsgType.DONE, rank=self.rank, epoch=self.epoch, step=self.step, pid=os.getpid())
        ok = link.wait(
            lambda: link.shutdown is not None or link.newer_epoch(),
            self.timeouts.notice_timeout_s,
        )
        if link.shutdown is not None:
            self._check_shutdown()
            return True
        if not ok:
            raise ResilienceError("finished, but the controller never confirmed the end of the job")
        self._driver.recover()
        return False

    def _abandoned(self) -> bool:
        """The epoch failed or a newer one was announced: this step cannot commit."""
        return self.intr.error is not None or (self.link is not None and self.link.newer_epoch())

    def sync(self) -> None:
        """Make this step's gradients identical across replicas. DDP and FSDP2 do it
        in their backward hooks (then this only checks they completed); a plain
        model's gradients are averaged here in one flat all-reduce. Idempotent."""
        if self.solo:
            return
        assert self._protocol is not None, "call job.attach(model, optimizer, ...) before job.sync()"
        self._protocol.sync()

    def commit(self) -> bool:
        """Vote, then step optimizer, GradScaler and scheduler only if every rank of
        the epoch completed this step's gradient sync. Returns False if the step
        was abandoned (a recovery ran; the loop resumes at the agreed step)."""
        protocol = self._protocol
        if protocol is None:
            raise ResilienceError("call job.attach(model, optimizer, ...) before job.commit()")
        if self.steps_state.yielded is None:  # the loop is what resumes at the agreed step after a recovery
            raise ResilienceError(
                "job.commit() outside the training loop: commit once per step inside `for step in job.steps(total)`"
            )
        twice = self.steps_state.count_commit()
        if twice is not None:
            raise ResilienceError(f"job.commit() called twice in step {twice}: exactly one commit per step")
        if self.solo:
            protocol.commit_alone()
            return True
        assert self.link is not None
        self.pace.slow_pct = self.link.inject_slow_pct
        self.pace.arrived()
        if self.link.inject_exception:
            raise RuntimeError("resild fault injection: exception raised in the training step")
        red = self.redundancy
        if red is not None and self.link.inject_corrupt:
            red.corrupt()
        if red is not None and self.link.inject_diverge:
            self.link.inject_diverge = False
            red.nudge()
        if red is not None and self.link.inject_badgrad:
            self.link.inject_badgrad = False
            red.bad_gradients(self.steps_state.step)
        if red is not None and red.verify_again(self.steps_state.step):
            return False  # --verify-every: job.steps() yields this step again, to be computed once more
        if protocol.vote():  # the after-commit hooks ran in it (snapshots, fingerprints, checkpoints)
            self._progress("commit", **self.pace.report(), of=self._total)
            if self._graphs_at_takeover is not None:
                self._report_compiled(self._graphs_at_takeover)
            return True
        self._driver.recover()
        return False

    def close(self) -> None:
        if self.link is not None:
            if self._agent is not None:
                self._agent.stop()
            self.link.close()


def init(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    extra: Any = None,
    replicas: Replicas | None = None,
    scaler: Any = None,
    prepare: Callable[[Any], None] | None = None,
) -> Job:
    """Join the job (or, run without resil-run, train alone). A spare blocks here,
    warm, until the controller gives it a failed node's ranks. With a model and
    optimizer the job is attached at once (plain data parallelism).

    `prepare(mesh)`: run by a spare while it waits (once the job has described its
    sharded state), on a DeviceMesh equal to the job's over stand-in groups: build,
    torch.compile and run the model once there (forward and backward on any batch), so
    that after the takeover the real model (another instance of the same classes)
    finds its graphs compiled. Its RNG use and default dtype are undone; an error in it
    is logged in one line and the spare compiles after the takeover."""
    try:
        return Job(model, optimizer, scheduler, extra, replicas, scaler=scaler, prepare=prepare)
    except ResilienceError as e:
        sys.stderr.write(f"resild: {e}\n")  # one write: every rank may say this at once, on one pipe
        raise SystemExit(2) from None
