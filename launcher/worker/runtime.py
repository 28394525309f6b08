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
`controller_link` (the controller link), `stable_group` (the stable process
group and backend factory), `recovery` (the sequence), `step_state` and
`commit` (the step's phases and the commit protocol), `state_transport` (the
replay), `train_state` (what is replayed); private torch APIs in `torch_private`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch

import resild.wire.env as resild_env
from launcher.worker.agent_link import AgentLink, agent_endpoint
from launcher.worker.commit import CommitProtocol
from launcher.worker.controller_link import ControlLink, keys_from_env
from launcher.worker.disk_checkpoint import DiskCheckpointer
from launcher.worker.fingerprint import fingerprint, judge
from launcher.worker.mesh_layout import MeshError, MeshLayout
from launcher.worker.recovery import Recovery, Reformed
from launcher.worker.replica_map import NoReplica, ReplicaMap
from launcher.worker.rollback import rollback
from launcher.worker.snapshot_exchange import Exchanger
from launcher.worker.snapshot_manager import SnapshotManager
from launcher.worker.snapshot_stage import DeviceStager
from launcher.worker.snapshots import NoSnapshot, PlacementError, SnapshotStore, check_placement
from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup, install_default, register
from launcher.worker.state_transport import Received, describe
from launcher.worker.step_state import StepState
from launcher.worker.torch_private import device_mesh_from_groups, hash_store, prewarm_lazy_imports, tcp_store
from launcher.worker.train_state import TrainState
from resild.events.schema import EventName
from resild.membership import Membership
from resild.wire.exits import FENCED_EXIT
from resild.wire.protocol import MsgType
from resild.wire.settings import WorkerRedundancy, WorkerTimeouts
from resild.wire.store import COMMITTED_KEY

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
    ) -> None:
        self.rank, self.world_size, self.epoch = 0, 1, 0
        self.steps_state = StepState()  # the step and its phase in the commit protocol
        self.state: TrainState | None = None
        self._protocol: CommitProtocol | None = None  # from attach on
        self._replicas: Replicas | None = replicas
        self._mesh_replicas: Replicas | None = None
        self._mesh: Any = None
        self._layout: MeshLayout | None = None
        self.intr = Interrupts()
        self.cfg: dict[str, Any] = {}
        self.timeouts = WorkerTimeouts.from_welcome({})  # alone (no controller): the defaults
        self.redundancy = WorkerRedundancy.from_welcome({})
        self.snap: SnapshotManager | None = None  # peer-memory snapshots (set up at attach)
        self.ckpt: DiskCheckpointer | None = None  # resild's own disk checkpoints (--checkpoint-dir)
        self._per_node = 1  # ranks per node (snapshot placement)
        self._snapshot_copies = 0
        self.link: ControlLink | None = None
        self._agent: AgentLink | None = None
        controller = os.environ.get(resild_env.CONTROLLER.name)
        self.solo = controller is None
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
        self.rec = Recovery(self.intr, GroupFactory("gloo", lambda: store, 60.0), self.device, 0.0)
        self._store = store
        self.rank, self.world_size, self.epoch = 0, 1, 1
        self._make_world(store)
        self.rec.form(1, [self.group])

    def _init_controlled(self, controller: str) -> None:
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
        self.redundancy = WorkerRedundancy.from_welcome(self.cfg)
        self.backend = os.environ.get(resild_env.BACKEND.name) or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout_s = self.timeouts.collective_timeout_s
        self._store = self._store_client()
        factory = GroupFactory(self.backend, self._store_client, timeout_s, os.environ.get(resild_env.GLOO_HOST.name))
        self.rec = Recovery(self.intr, factory, self.device, timeout_s + 5.0)
        self._install_excepthook()
        ep = agent_endpoint()
        self._agent = AgentLink(ep, f"{self.node}/rank{self.local_rank}", lambda: self.step).start() if ep else None
        # A spare waits here, warm (torch imported, CUDA context up), until it is given ranks.
        if not link.wait(lambda: link.pending is not None or link.shutdown is not None, 0.5):
            prewarm_lazy_imports()
        m, self.rank = wait_for_ranks(
            link, self.node, self.local_rank, lambda: self._check_shutdown(waiting_spare=True)
        )
        self.world_size, self.epoch = m.world_size, m.epoch
        self._per_node = len(m.node_ranks.get(self.node, ())) or 1
        if self.epoch > 1:  # a spare taking over: building the model may take a while, and that is no hang
            self._progress("join")
        self._make_world(self._store)
        self._form_until_stable(only=[self.group])

    def _make_world(self, store: Any) -> None:
        self.group: StableGroup = StableGroup("world", list(range(self.world_size)), self.rank, self.intr)
        self.rec.groups["world"] = self.group
        install_default(self.group, store)

    def _store_client(self) -> Any:
        # The newest welcome's store: a standby controller that takes over brings its own.
        addr = str((self.link.welcome or {}).get("store") or self.cfg["store"]) if self.link else self.cfg["store"]
        host, port = addr.rsplit(":", 1)
        return tcp_store(host, int(port), timedelta(seconds=float(self.cfg.get("store_timeout_s", 60))))

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
        groups: list[StableGroup] = []
        fresh: list[StableGroup] = []
        for dim in range(len(layout.shape)):
            label, ranks = layout.group(dim, self.rank)
            g = self.rec.groups.get(label) or StableGroup(label, ranks, self.rank, self.intr)
            if label not in self.rec.groups:
                g.allow = self.group.allow
                register(g, self._store)
                self.rec.groups[label] = g
                fresh.append(g)
            groups.append(g)
        if fresh:
            self._form_until_stable(only=fresh)
        self._layout = layout
        self._mesh_replicas = lambda w: layout.replicas()
        mesh_ranks = torch.arange(layout.world_size).view(*layout.shape)
        self._mesh = device_mesh_from_groups(groups, device_type or self.device.type, mesh_ranks, layout.names)
        return self._mesh

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
        self._protocol = CommitProtocol(self.steps_state, self.state, self.group, self.intr, self._abandoned)
        if replicas is not None:
            self._replicas = replicas
        self.steps_state.committed_aux = self.state.capture_aux()
        for g in self.rec.groups.values():
            g.allow = True
        if not self.solo:
            self._setup_snapshots()
            self._setup_checkpoints()
            try:
                self._join()
            except Reformed:
                self._recover()
        return self

    def _setup_snapshots(self) -> None:
        """Peer-memory snapshots for ranks no replica covers (or as many copies as asked)."""
        rm = self._replica_map()
        has_replicas = all(len(g) > 1 for g in rm.groups)
        nodes = self.world_size // self._per_node
        copies = self.redundancy.copies(has_replicas, nodes)
        if copies <= 0:
            if not has_replicas and self.rank == 0:
                asked = self.redundancy.snapshot_copies
                print(
                    "resild: no rank's state has a replica and no snapshot copies are kept "
                    f"(--snapshot-copies {asked if asked >= 0 else 'auto'}, "
                    f"{nodes} node(s)): "
                    "losing a node will stop the job",
                    file=sys.stderr,
                    flush=True,
                )
            return
        try:
            check_placement(self.world_size, self._per_node, copies)
        except PlacementError as e:
            raise ResilienceError(str(e)) from None
        g = StableGroup("resild-snapshot", list(range(self.world_size)), self.rank, Interrupts())
        g.backend = "gloo"  # snapshots live in host memory, whatever the training backend
        register(g, self._store)
        self.rec.groups[g.label] = g
        self._form_until_stable(only=[g])
        store = SnapshotStore(self.rank)
        exchanger = Exchanger(store, g, self.rank, self.world_size, self._per_node, copies)
        assert self._protocol is not None
        stager = DeviceStager(self.device) if self.device.type == "cuda" else None
        self.snap = SnapshotManager(store, exchanger, self.redundancy.snapshot_every, self._protocol.snapshot, stager)
        self._snapshot_copies = copies
        self._protocol.snap = self.snap

    def _setup_checkpoints(self) -> None:
        """resild's own disk checkpoints, on a gloo group of their own (DCP's collectives
        run in the writer thread and must not mix with the training thread's)."""
        r = self.redundancy
        if not r.checkpoint_dir:
            return
        g = StableGroup("resild-checkpoint", list(range(self.world_size)), self.rank, Interrupts())
        g.backend = "gloo"
        g.allow = True
        register(g, self._store)
        self.rec.groups[g.label] = g
        self._form_until_stable(only=[g])
        self.ckpt = DiskCheckpointer(
            Path(r.checkpoint_dir), r.checkpoint_every, self.rank, self.world_size, g, keep=2, intr=g._intr
        )
        self._ckpt_group = g

    def _agreed_checkpoint(self) -> int | None:
        """The newest complete checkpoint, as every rank sees it (one all-reduce: a rank
        with a stale listing must not leave the others in DCP's collectives alone)."""
        assert self.ckpt is not None
        mine = self.ckpt.newest_complete()
        seen = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        seen[self.rank] = (mine if mine is not None else -1) + 1
        self.rec.wait(self.rec.groups["world"]._inner.allreduce([seen]))
        views = set(seen.cpu().tolist())
        if len(views) > 1:
            self._fatal(
                f"ranks see different newest checkpoints in {self.ckpt.directory} (steps "
                f"{sorted(v - 1 for v in views)}): --checkpoint-dir must be one shared file system"
            )
        step = views.pop() - 1
        return step if step >= 0 else None

    def _load_checkpoint(self, why: str) -> int:
        """Every in-memory copy of some state is gone: every rank loads the newest complete
        checkpoint in-process (no restart), or the job stops with one line."""
        ck = self.ckpt
        assert ck is not None and self.state is not None
        step = self._agreed_checkpoint()
        if step is None:
            self._fatal(f"{why}; and no complete checkpoint in {ck.directory} yet")
        t0 = time.monotonic()
        aux = ck.load(step, self.state)
        self.state.rewind_aux(aux) if aux else self.state.rewind_aux(self.steps_state.committed_aux)
        self.steps_state.replayed(step, self.state.capture_aux())
        self.state.reset_hooks(aux.get("ddp_buckets") if aux else None)
        print(
            f"resild: rank {self.rank} loaded checkpoint step {step} in {time.monotonic() - t0:.3f}s",
            file=sys.stderr,
            flush=True,
        )
        if self.rank == 0:
            self._event(EventName.CHECKPOINT_LOADED, step=step, seconds=round(time.monotonic() - t0, 4), why=why[:300])
        return step

    # ---- messages and failures -----------------------------------------------------
    def _install_excepthook(self) -> None:
        # Interpreter teardown with torch loaded takes ~1-2 s; report the failure first.
        prev = sys.excepthook

        def hook(tp: type, value: BaseException, tb: Any) -> None:
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
                prev(tp, value, tb)

        sys.excepthook = hook

    def _check_shutdown(self, waiting_spare: bool = False) -> None:
        s = self.link.shutdown if self.link is not None else None
        if s is None:
            return
        if int(s.get("exit_code", 1)) != 0:
            raise SystemExit(f"resild: job stopped by the controller: {s.get('reason')}")
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

    def _await_notice(self, why: str) -> None:
        """A collective failed with no new membership yet: only the controller knows.
        The report makes it probe every node at once instead of waiting for heartbeats."""
        self._progress("collective_failed", error=why[:300])
        link = self.link
        assert link is not None
        ok = link.wait(
            lambda: link.newer_epoch() or link.shutdown is not None,
            self.timeouts.notice_timeout_s,
        )
        self._check_shutdown()
        if not ok:
            raise ResilienceError(f"collective failed ({why}) and no new membership came within the notice timeout")

    # ---- recovery -------------------------------------------------------------------
    def _form_until_stable(self, only: list[StableGroup]) -> None:
        try:
            self.rec.form(self.epoch, only)
        except Reformed:
            self._recover()

    def _recover(self) -> None:
        """Run the recovery sequence until one epoch completes it."""
        link = self.link
        assert link is not None
        if self.snap is not None:
            self.snap.abandon()  # a snapshot in flight belongs to the failed epoch
        if self.ckpt is not None:  # so is a checkpoint being written: release its collectives
            self.ckpt.abandon()
            self._ckpt_group._intr.fail("a new epoch")
        while True:
            self._check_shutdown()
            if not link.newer_epoch():
                self._await_notice(self.intr.error or "collective failed")
            m = link.take()
            assert m is not None
            rank = m.rank_of(self.node, self.local_rank)
            if rank is None:
                os._exit(FENCED_EXIT)  # not in the new membership: we were fenced
            if rank != self.rank or m.world_size != self.world_size:
                raise ResilienceError(
                    f"membership epoch {m.epoch} moved rank {self.rank} to {rank}: "
                    "resild replaces failed nodes one for one, it never renumbers survivors"
                )
            self.epoch = m.epoch
            self.rec.retire()
            self.intr.clear()
            if link.newer_epoch():
                continue
            t0 = time.monotonic()
            try:
                formed_s = self.rec.form(m.epoch, list(self.rec.groups.values()))
                if self.ckpt is not None:
                    self._ckpt_group._intr.clear()  # a new generation: the abandoned save never completes
                if self.rank == 0:
                    self._event(EventName.GROUP_REFORMED, seconds=round(formed_s, 4), world_size=self.world_size)
                if self.state is not None:
                    self._join(t0)
                return
            except Reformed:
                continue

    def _join(self, t0: float | None = None) -> None:
        """Agree on the newest committed step; roll forward or receive state: from a
        replica where one holds it, else by rolling every rank back to a snapshot."""
        protocol = self._protocol
        assert protocol is not None
        t0 = t0 or time.monotonic()
        floor = self._floor()
        ag = self.rec.agree(self.rank, self.world_size, self.steps_state.agreement_row(), floor)
        if self.snap is not None:
            self.snap.before_write()  # rolling forward or restoring writes the live state
        protocol.settle(ag, self.rank)  # roll forward or abandon; the agreed step is computed afresh
        try:
            if ag.target < floor:
                raise NoReplica(
                    f"every rank holding committed step {floor} was lost (the newest state left is step "
                    f"{ag.target}): checkpointless recovery is impossible; restart from a disk checkpoint"
                )
            target, got = self.rec.replay(
                ag.steps,
                self._replica_map(),
                self.rank,
                int(self.cfg.get("replay_sources", 2)),
                protocol.snapshot,
            )
            source = "replica"
        except (NoReplica, ValueError) as e:
            target, got, source = self._without_replica(ag.target, str(e))
        if source == "checkpoint":
            pass  # the live objects were loaded in place
        elif target == 0 and self.ckpt is not None and self._agreed_checkpoint() is not None:
            # A fresh start (every rank at step 0) with checkpoints on disk: a requeued or
            # resubmitted job resumes from the newest, with no user code.
            target, got, source = self._load_checkpoint(f"resuming from {self.ckpt.directory}"), None, "checkpoint"
        else:
            protocol.resume(got)
        if self.snap is not None:
            self.snap.after_recovery(target)
            if target == 0:  # the start (or a fault before the first commit): protect the initial state
                self.snap.after_commit(0, vote=1)
        if got is not None and got.sources != [self.rank]:  # not a restore of this rank's own snapshot
            print(f"resild: rank {self.rank} replayed {describe(got)} ({source})", file=sys.stderr, flush=True)
            self._event(
                EventName.STATE_REPLAYED,
                bytes=got.nbytes,
                seconds=round(got.seconds, 4),
                step=target,
                sources=got.sources,
                mb_per_s=round(got.nbytes / 1e6 / max(got.seconds, 1e-9), 1),
                source=source,
            )
        if self.epoch > 1:
            self._progress("joined")
        if self.rank == 0 and self.epoch > 1:
            self._event(EventName.RESUMED, step=target, seconds=round(time.monotonic() - t0, 4), source=source)

    def _without_replica(self, newest: int, why: str) -> tuple[int, Received | None, str]:
        """No replica holds some lost rank's state: roll back to peer-memory snapshots,
        else load resild's newest disk checkpoint, else stop."""
        if self.snap is not None:
            try:
                target, got = self._rollback(newest, why)
                return target, got, "snapshot"
            except NoSnapshot as e:
                why = f"{why.split(': checkpointless')[0]}; {e}"
        if self.ckpt is not None:
            return self._load_checkpoint(why), None, "checkpoint"
        if self.snap is not None:
            why += ": checkpointless recovery is impossible; restart from a disk checkpoint"
        self._fatal(why)

    def _fatal(self, why: str) -> NoReturn:
        """Every rank computes the same plan, so every rank lands here: stop the job."""
        if self.link is not None:
            self.link.send(MsgType.FATAL, error=why)
            self.link.close(flush_s=1.0)
        raise ResilienceError(why) from None

    def _rollback(self, newest: int, why: str) -> tuple[int, Received | None]:
        """No replica of some rank's state: every rank goes back to the newest snapshot
        complete for all (its own copy, or one fetched from a holder on another node)."""
        snap = self.snap
        assert snap is not None and self.state is not None
        t0 = time.monotonic()
        width = 2 * (1 + self._snapshot_copies) + 2
        try:
            step, frozen, plan, damaged = rollback(
                self.rec.groups["world"]._inner,
                lambda w: self.rec.wait(w, p2p=True),
                snap.store,
                self.rank,
                self.world_size,
                newest,
                width,
                attempts=1 + self._snapshot_copies,
            )
        except NoSnapshot:
            self._corrupt_events(snap)
            raise
        self._corrupt_events(snap)
        if self.rank == 0:
            for holder, src, s in damaged:
                self._event(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=holder, found="transfer")
            self._event(EventName.ROLLED_BACK, step=step, newest=newest, steps_redone=newest - step, fetches=len(plan))
        if frozen is not None:
            state, aux = frozen.thaw()
            holder = next(f.holder for f in plan if f.src == self.rank)
            return step, Received(state, aux, frozen.nbytes, [holder], time.monotonic() - t0)
        if self.steps_state.step == step:
            return step, None  # the live state is that step: only the aux rewinds
        own = snap.store.get(self.rank, step)
        assert own is not None
        state, aux = own.thaw()
        return step, Received(state, aux, 0, [self.rank], time.monotonic() - t0)

    def _corrupt_events(self, snap: SnapshotManager) -> None:
        for src, s in snap.store.corrupt_found:
            self._event(EventName.SNAPSHOT_CORRUPT, src=src, step=s, holder=self.rank, found="verify")
        snap.store.corrupt_found.clear()

    def _floor(self) -> int:
        """The newest step the controller knew committed at the last failure (the
        runner publishes it in the store): below it, every replica of the state is gone."""
        if self.solo or self.epoch <= 1:
            return 0
        store = self._store_client()  # the current leader's store (it moves with the leader)
        if not store.check([COMMITTED_KEY]):
            return 0
        return int(store.get(COMMITTED_KEY))

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
            while st.step < total:
                st.open_step()
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
        self._report_snapshots()
        if self.ckpt is not None and not self.ckpt.wait(self.timeouts.collective_timeout_s):
            log.warning("the last disk checkpoint did not finish before the end of the job")
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
        self._recover()
        return False

    def _report_snapshots(self) -> None:
        """What snapshots cost this rank (bench/snapshots.py reads it), before DONE: the
        controller stops listening once every rank is done."""
        if self.snap is None:
            return
        s = self.snap
        self._event(
            EventName.SNAPSHOTS,
            copies=self._snapshot_copies,
            every=s.cadence.every,
            taken=s.taken,
            skipped=s.skipped,
            capture_s=round(s.capture_s, 4),
            exchange_s=round(s.exchanger.last_s, 4),
            held_bytes=s.store.nbytes,
        )

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
        if self.link.inject_exception:
            raise RuntimeError("resild fault injection: exception raised in the training step")
        if self.link.inject_corrupt and self.snap is not None:
            self.snap.store.corrupt_now()
        if self.link.inject_diverge:
            self.link.inject_diverge = False
            self._nudge()
        if protocol.vote():
            self._progress("commit")
            every = self.redundancy.fingerprint_every
            if every and self.step % every == 0:
                self._compare_replicas()
            if self.ckpt is not None and self.state is not None and self.ckpt.due(self.step):
                self.ckpt.save(self.step, self.state, self.steps_state.committed_aux)
            return True
        self._recover()
        return False

    def _nudge(self) -> None:
        """Fault injection: what a GPU computing wrong numbers leaves behind."""
        assert self.state is not None
        p = next(iter(self.state.model.parameters()))
        with torch.no_grad():
            (p.to_local() if hasattr(p, "to_local") else p).view(-1)[0] += 1e-3

    def _compare_replicas(self) -> None:
        """Silent divergence: every rank's state fingerprint, in one all-reduce; a rank its
        replicas outvote leaves (its node is replaced and the state replayed from them)."""
        assert self.state is not None
        vals = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        vals[self.rank] = fingerprint(self.state.snapshot(self.step))
        self.group.allreduce([vals]).wait()
        if self.intr.error is not None:
            return  # the epoch is failing: the next vote finds out
        verdict = judge(vals.cpu().tolist(), self._replica_map().groups)
        if verdict.clean:
            return
        if self.rank == 0:
            self._event(
                EventName.REPLICA_DIVERGED,
                step=self.step,
                odd=list(verdict.odd),
                undecided=[list(g) for g in verdict.undecided],
            )
        if verdict.undecided:
            self._fatal(
                f"replicas {[list(g) for g in verdict.undecided]} hold different state at step {self.step} and no "
                "majority says which is right: a faulty device; restart from a checkpoint"
            )
        if self.rank in verdict.odd:
            raise RuntimeError(
                f"resild: rank {self.rank}'s state diverged from its replicas at step {self.step} (fingerprints "
                "differ): a faulty device; this node leaves and a spare takes its ranks"
            )

    def close(self) -> None:
        if self.link is not None:
            if self._agent is not None:
                self._agent.stop()
            self.link.close()


def wait_for_ranks(
    link: ControlLink, node: str, local_rank: int, check_shutdown: Callable[[], None]
) -> tuple[Membership, int]:
    """A spare waits for a membership that gives it a rank; epochs that leave it out
    are taken and passed over. The rank is read from the membership taken: a newer
    one may replace the pending one between a look and the take."""
    while True:
        link.wait(lambda: link.pending is not None or link.shutdown is not None, 3600.0)
        check_shutdown()
        m = link.take()
        if m is None:
            continue
        rank = m.rank_of(node, local_rank)
        if rank is not None:
            return m, rank


def init(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    *,
    extra: Any = None,
    replicas: Replicas | None = None,
    scaler: Any = None,
) -> Job:
    """Join the job (or, run without resil-run, train alone). A spare blocks here,
    warm, until the controller gives it a failed node's ranks. With a model and
    optimizer the job is attached at once (plain data parallelism)."""
    try:
        return Job(model, optimizer, scheduler, extra, replicas, scaler=scaler)
    except ResilienceError as e:
        print(f"resild: {e}", file=sys.stderr)
        raise SystemExit(2) from None
