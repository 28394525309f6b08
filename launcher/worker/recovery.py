"""The recovery sequence, one epoch at a time:

  take the new membership -> abort the old backends in the background -> form the new
  backends for every group (fresh store prefix) -> agree on the newest committed
  step -> prepared ranks roll forward -> replay state from replicas -> rewind.

A newer epoch at any point restarts the sequence; a collective failure with no
notice yet asks the controller for one. Every rank computes the same plan from
the same agreed vector, so a plan that cannot be carried out (every replica of
a shard lost) fails on every rank alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from launcher.worker.group_auth import prove_pairs
from launcher.worker.old_backends import OldBackends, injected_delay
from launcher.worker.replica_map import ReplicaMap, plan_replay
from launcher.worker.stable_group import GroupFactory, Interrupts, ManagedWork, StableGroup, abort, wait_mode
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import Mac
from launcher.worker.transport.state_transport import P2PTransport, Received, Source, prepare


class DamagedReplay(ValueError):
    """A replayed transfer failed its checksum: the state it carried is not loaded."""


class Reformed(Exception):
    """A newer epoch was announced, or the current one failed: start again."""


@dataclass
class Agreement:
    target: int
    rollers: list[int]  # ranks one step behind that hold this step's synced gradients
    found_inf: int  # the committed step's GradScaler verdict, for the rollers
    steps: list[int]  # every rank's step once the rollers have rolled forward
    rows: list[list[int]] = field(default_factory=list)  # every rank's row, as agreed on


def agree(rows: list[list[int]], floor: int = 0) -> Agreement:
    """rows[r] = (step, prepared, found_inf, ...): found_inf is the GradScaler verdict of
    r's last commit, or, for a prepared rank, its local verdict on the step it voted
    for (-1 unknown). `floor`: the newest step the controller saw committed. Pure.

    The newest step held wins. Ranks that voted for the step after it roll forward
    when someone committed that step, which the controller may know although the
    rank that committed it is gone."""
    top = max(r[0] for r in rows)
    target = top
    if floor == top + 1 and any(r[0] == top and r[1] == 1 for r in rows):
        target = floor
    rollers = [i for i, r in enumerate(rows) if r[0] == target - 1 and r[1] == 1]
    committed = [r[2] for r in rows if r[0] == target and r[1] == 0 and r[2] >= 0]
    found = committed[0] if committed else int(any(rows[i][2] > 0 for i in rollers))
    steps = [target if i in rollers else r[0] for i, r in enumerate(rows)]
    return Agreement(target, rollers, found, steps, rows)


class RecoverySequence:
    """Owns the epoch's backends for every StableGroup of this rank."""

    def __init__(self, intr: Interrupts, factory: GroupFactory, device: torch.device, bury_s: float) -> None:
        self.intr, self.factory, self.device, self.bury_s = intr, factory, device, bury_s
        self.groups: dict[str, StableGroup] = {}
        self.epoch = 0
        delay_s, self._fence_gloo = injected_delay()
        self.old = OldBackends(abort, bury_s, delay_s)
        self.abort_wait_s = 0.0  # the last forming's wait for the old communicators' aborts
        self.mac: Mac | None = None  # the job's data key (WELCOME): state on the wire is authenticated
        self._replays = 0  # in this epoch: with the epoch, what makes each replay's message keys its own
        self._prepared: Source | None = None  # what this rank would send, made while the groups formed
        self.prepared_used = 0  # replays that sent what was prepared (a count, for tests and benches)
        intr.on_fail.append(self._abort_streams)

    def _abort_streams(self) -> None:
        """On an interrupted epoch (called where it is latched, often the control thread):
        start aborting this epoch's NCCL communicators, which releases a kernel hung on a
        dead peer and so every CPU wait behind it (a `.item()`, a stream sync). gloo's abort
        interrupts nothing; its waits watch the epoch instead (`WaitMode`)."""
        doomed = [g.pg for g in list(self.groups.values()) if g.pg is not None and g.kind == "nccl"]
        self.old.abort(doomed, fenced=True)

    # ---- waiting ----------------------------------------------------------------
    def wait(self, work: Any, untimed: bool = False) -> None:
        """Wait on a backend work while watching the epoch: a latched error raises."""
        kind = self.groups["world"].kind if "world" in self.groups else None
        mw = work if isinstance(work, ManagedWork) else ManagedWork(work, None, self.intr, wait_mode(kind, untimed))
        mw.wait()
        if self.intr.error is not None:
            raise Reformed(self.intr.error)

    def read(self, t: torch.Tensor) -> list[Any]:
        """A collective's result, on the host. On NCCL `wait()` only orders streams and
        this read is what blocks; an abort releases it with garbage, so the latched error
        (set before the abort) is checked after the read, never only before."""
        out = t.cpu().tolist()
        if self.intr.error is not None:
            raise Reformed(self.intr.error)
        return out

    # ---- forming ------------------------------------------------------------------
    def retire(self) -> None:
        """Detach the old backends and abort them off the critical path (old_backends):
        returns at once, the new ones form meanwhile and `form` fences what must be."""
        old = [(g.pg, g.kind) for g in self.groups.values() if g.pg is not None]
        for g in self.groups.values():
            g.set_backend(None)
        self._prepared = None
        self.old.abort([pg for pg, kind in old if kind == "nccl"], fenced=True)
        self.old.abort([pg for pg, kind in old if kind != "nccl"], fenced=self._fence_gloo)

    def replay_mac(self) -> Mac | None:
        """What a replica replay's messages are tagged under: the job's data key on the
        host; a CUDA replay keeps its device checksum (no MAC on the GPU)."""
        return self.mac if self.device.type == "cpu" else None

    def form(self, epoch: int, groups: list[StableGroup], meanwhile: Callable[[], None] | None = None) -> float:
        """Build this epoch's backends for `groups`, in parallel (gloo's full-mesh
        connect blocks until every member arrives), running `meanwhile` on this thread
        while they connect. Returns seconds taken."""
        t0 = time.monotonic()
        out: dict[str, Any] = {}
        threads = []
        lock, abandoned = threading.Lock(), threading.Event()
        for g in groups:

            def build(g: StableGroup = g) -> None:
                try:
                    built: Any = self._proven(epoch, g, self.factory.build(epoch, g))
                except Exception as e:
                    built = e
                with lock:
                    if abandoned.is_set():  # the formation went on without it: nothing will use it
                        self._retire_built([built])
                    else:
                        out[g.label] = built
                with self.intr.cond:
                    self.intr.cond.notify_all()

            th = threading.Thread(target=build, name=f"resild-form-e{epoch}-{g.label}", daemon=True)
            th.start()
            threads.append(th)
        if meanwhile is not None:
            meanwhile()
        token = self.intr.begin_wait()
        try:
            formed = self.intr.wait_until(lambda: len(out) == len(groups))
        finally:
            self.intr.done(token)
        if not formed or any(isinstance(v, Exception) for v in out.values()):
            with lock:  # what formed is retired, what forms later retires itself
                abandoned.set()
                self._retire_built(list(out.values()))
        if not formed:
            raise Reformed(self.intr.error or "interrupted")  # abandoned: the threads fail on their own
        errors = [f"{k}: {v}" for k, v in out.items() if isinstance(v, Exception)]
        if errors:
            self.intr.fail(f"forming epoch {epoch}: {'; '.join(errors)}")
            raise Reformed(self.intr.error or "")
        # Nothing runs on the new backends before the old communicators' last write.
        token = self.intr.begin_wait()  # waiting on aborts, not hung
        try:
            self.abort_wait_s = self.old.fence(self.bury_s)  # AbortStuck: this rank cannot go on
        finally:
            self.intr.done(token)
        if self.intr.error is not None:  # failed while fenced: nothing aborts what is not installed
            self._retire_built([out[g.label] for g in groups])
            raise Reformed(self.intr.error)
        for g in groups:
            g.set_backend(out[g.label])
        if epoch != self.epoch:
            self.epoch, self._replays = epoch, 0
        return time.monotonic() - t0

    def _retire_built(self, built: list[Any]) -> None:
        """Backends a failed or abandoned formation built: aborted off this thread, as a
        failed epoch's are (a stranger could otherwise make a rank leak one per attempt)."""
        pgs = [b for b in built if not isinstance(b, Exception)]
        self.old.abort([pg for pg in pgs if str(pg.name()) == "nccl"], fenced=True)
        self.old.abort([pg for pg in pgs if str(pg.name()) != "nccl"], fenced=self._fence_gloo)

    def _proven(self, epoch: int, g: StableGroup, pg: Any) -> Any:
        """`pg` once every peer's connection proved the job's data key (group_auth), on a
        host group of a job that has one; else retired, and the formation fails."""
        if self.mac is None or str(pg.name()) != "gloo":
            return pg
        # bounded by the collective timeout: a silent stranger must not hold a formation for a
        # long-lived group's timeout (the checkpoint group's is an hour)
        timeout_s = min(self.factory.timeout_s_for(g), self.factory.timeout_s)
        try:
            prove_pairs(pg, self.mac, epoch, g.store_key, g.rank(), g.size(), timeout_s)
        except Exception:
            self.old.abort([pg], fenced=self._fence_gloo)
            raise
        return pg

    # ---- agreeing and replaying -------------------------------------------------
    def prepare_source(
        self, snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]], token: Callable[[], Any]
    ) -> None:
        """Walk and pack what this rank would send in a replay (state_transport.prepare),
        for `replay` to use if the state is still the same then. Host replays only: on a
        GPU, taking the state view (a GradScaler's `.item()`, FSDP2's state-dict hooks)
        could queue behind an old communicator's kernels before they are fenced."""
        self._prepared = None
        if self.device.type != "cpu":
            return
        try:
            self._prepared = prepare(snapshot, self.device, token)
        except Exception:
            pass  # never a reason to fail a recovery: the replay takes the state itself, and says why

    def forget_prepared(self) -> None:
        self._prepared = None  # the live tensors it packed may be freed

    def agree(self, rank: int, world: int, row: tuple[int, ...], floor: int = 0) -> Agreement:
        rows = torch.zeros(world, len(row), dtype=torch.int64, device=self.device)
        rows[rank] = torch.tensor(row, dtype=torch.int64)
        self.wait(self.groups["world"].pg.allreduce([rows]))
        return agree(self.read(rows), floor)

    def replay(
        self,
        steps: list[int],
        replicas: ReplicaMap,
        rank: int,
        max_sources: int,
        snapshot: Any,
        receive_into: Any = None,
        landing: LandingPool | None = None,
    ) -> tuple[int, Received | None]:
        """`receive_into`: this rank's live state, to be written in place if it receives
        (state_transport); called only then. `landing`: host memory a spare touched for
        what has no live home (launcher.worker.transport.landing_pool)."""
        target, plan = plan_replay(steps, replicas, max_sources)
        pg = self.groups["world"].pg
        mac = self.replay_mac()
        self._replays += 1  # alike on every rank: each runs the same sequence
        names = (self.epoch, self._replays)
        transport = P2PTransport(pg, self.device, lambda w: self.wait(w, untimed=True), landing, mac, names)
        prepared, self._prepared = self._prepared, None
        if prepared is not None and not (any(t.src == rank for t in plan) and prepared.unchanged()):
            prepared = None  # not a source, or rolled forward or back since: what it packed is stale
        self.prepared_used += prepared is not None
        got = transport.exchange(plan, rank, snapshot, receive_into, prepared)
        if not plan:
            return target, got
        # Every rank learns whether any transfer arrived damaged, so all take the same next step.
        bad = torch.tensor([len(got.damaged) if got is not None else 0], dtype=torch.int64, device=self.device)
        self.wait(pg.allreduce([bad]))
        (n_bad,) = self.read(bad)
        if n_bad:
            raise DamagedReplay(
                f"{n_bad} replayed transfer(s) failed their checksum"
                + (f" (from rank(s) {list(got.damaged)} to rank {rank})" if got is not None and got.damaged else "")
            )
        return target, got
