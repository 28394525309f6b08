"""Peer-memory snapshots: what a rank holds of its own and of others' state.

After a commit, every rank freezes its local state (DTensor local shards of
model and optimizer, scheduler, scaler, RNG, data position, step) into one
host buffer with a CRC-32, keeps it, and sends a copy to `copies` ranks on
other nodes (`holders`). Placement is by node: ranks are laid out node by node
(rank = node index x ranks per node + local rank), so the k-th copy of rank r
goes to rank r + k x ranks_per_node, on the k-th next node. Two adjacent nodes
lost together still leave the second copy of each when `copies` >= 2.

Double-buffered: a snapshot in flight never replaces the newest one every
rank confirmed complete (the commit vote carries "my exchange is done"); only
once the next one is confirmed is the older dropped. Every copy is verified
against its CRC before it is offered for recovery, and again on arrival.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from launcher.worker.transport.codec import (
    Run,
    aligned,
    checksum,
    encode,
    pack_plan,
    pack_runs,
    skeleton,
    unflatten,
    unpack_into,
)
from launcher.worker.transport.landing_pool import LandingPool
from launcher.worker.transport.mac import SNAPSHOT, Mac, new_nonce

# step, crc, skeleton bytes, aux skeleton bytes, aux buffer bytes, state buffer bytes, source rank,
# then with the job's data key: the nonce and the two words of the tag (0 without)
HEADER_LEN = 10


class PlacementError(ValueError):
    """The job is too small for the copies asked: the message names the fix."""


def holders(rank: int, world_size: int, per_node: int, copies: int) -> list[int]:
    """The ranks (on the `copies` next nodes) that hold copies of `rank`'s snapshots."""
    return [(rank + k * per_node) % world_size for k in range(1, copies + 1)]


def sources(rank: int, world_size: int, per_node: int, copies: int) -> list[int]:
    """The ranks whose snapshots `rank` holds (inverse of `holders`), k = 1..copies."""
    return [(rank - k * per_node) % world_size for k in range(1, copies + 1)]


def check_placement(world_size: int, per_node: int, copies: int) -> None:
    nodes = world_size // max(1, per_node)
    if copies < 0:
        raise PlacementError(f"--snapshot-copies must be >= 0, not {copies}")
    if copies and (per_node <= 0 or world_size % per_node or copies >= nodes):
        nodes = nodes if per_node > 0 and world_size % per_node == 0 else 0
        raise PlacementError(
            f"--snapshot-copies {copies} needs at least {copies + 1} active nodes (each copy on another node); "
            f"this job has {nodes}: lower --snapshot-copies or add nodes"
        )


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Layout:
    """Where each part of a snapshot goes in its payload: [skeleton | aux skeleton | aux
    tensors | zeros to an ALIGN-ed offset | state tensors]. The host parts (skeletons, RNG)
    are small; the state's tensors go a run per dtype and shape (`codec.pack_plan`: the
    receiver of a copy computes the same runs from the skeleton), copied with one call
    per run on the host (the CPU capture) or one per tensor on a side stream (the GPU's)."""

    skel: bytes
    askel: bytes
    head: list[torch.Tensor]  # uint8, host: skeleton, aux skeleton, aux tensors
    n_abuf: int
    tensors: list[torch.Tensor]  # the state's, uncopied
    runs: list[Run]
    n_body: int

    @staticmethod
    def of(state: Any, aux: Any) -> Layout:
        skel, tensors, specs = encode(state)
        askel, atensors = skeleton(aux)
        abuf = [_bytes_of(t).cpu() for t in atensors]
        head = [_bytes_tensor(skel), _bytes_tensor(askel), *abuf]
        runs, n_body = pack_plan(specs)
        return Layout(skel, askel, head, sum(t.numel() for t in abuf), tensors, runs, n_body)

    @property
    def body_at(self) -> int:
        return body_at(len(self.skel), len(self.askel), self.n_abuf)

    @property
    def nbytes(self) -> int:
        return self.body_at + self.n_body

    def write_head(self, payload: torch.Tensor) -> int:
        """Copy the host parts to the front of `payload` (and zeros up to the body);
        -> where the body starts."""
        off = 0
        for t in self.head:
            payload[off : off + t.numel()].copy_(t)
            off += t.numel()
        payload[off : self.body_at].zero_()
        return self.body_at

    def write_body(self, payload: torch.Tensor) -> None:
        """The state's tensors into `payload`'s body, one stack per run of small ones."""
        pack_runs(self.tensors, self.runs, payload[self.body_at : self.nbytes])

    def frozen(self, step: int, src: int, payload: torch.Tensor, ready: Any = None) -> Frozen:
        return Frozen(step, src, len(self.skel), len(self.askel), self.n_abuf, payload, ready=ready)


def body_at(n_skel: int, n_askel: int, n_abuf: int) -> int:
    """Where a payload's state body starts: ALIGN-ed, so that each run's tensors can be
    seen in place as their dtype."""
    return aligned(n_skel + n_askel + n_abuf)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@dataclass
class Frozen:
    """One rank's state at one step as a single host byte buffer:
    [skeleton | aux skeleton | aux buffer | state buffer], with its CRC."""

    step: int
    src: int
    n_skel: int
    n_askel: int
    n_abuf: int
    payload: torch.Tensor  # uint8, CPU
    crc: int = -1  # -1: not computed yet (the exchange thread computes it off the critical path)
    ready: Any = None  # a CUDA event: the device-to-host copy into `payload` is still in flight until it
    nonce: int = 0
    tag: tuple[int, ...] | None = None  # under the job's data key: set once, by its own rank, when it is sent

    @staticmethod
    def capture(step: int, src: int, state: Any, aux: Any) -> Frozen:
        """Copy now (the next optimizer step overwrites the live tensors); checksum later."""
        lay = Layout.of(state, aux)
        # One copy of each tensor, straight into the payload (flatten + cat would copy twice).
        payload = torch.empty(lay.nbytes, dtype=torch.uint8)
        lay.write_head(payload)
        lay.write_body(payload)
        return lay.frozen(step, src, payload)

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def seal(self, mac: Mac | None = None) -> Frozen:
        """Its CRC (memory damage is found by it while it is held); with the job's data key,
        its tag too (the wire: a copy from anyone without the key is refused on arrival)."""
        self.wait_ready()
        if self.crc < 0:
            self.crc = checksum(self.payload)
        if mac is not None and self.tag is None:
            self.nonce = new_nonce()
            self.tag = mac.tag([self.payload], *self._names())
        return self

    def _names(self) -> tuple[int, ...]:
        return (SNAPSHOT, self.src, self.step, self.nonce, self.n_skel, self.n_askel, self.n_abuf, self.nbytes)

    def authentic(self, mac: Mac | None) -> bool:
        """Sent by a rank of this job (always, where the job has no data key)."""
        if mac is None:
            return True
        self.wait_ready()
        return self.tag is not None and self.tag == mac.tag([self.payload], *self._names())

    def verify(self) -> bool:
        self.wait_ready()
        return self.crc >= 0 and checksum(self.payload) == self.crc

    def header(self, mac: Mac | None = None) -> torch.Tensor:
        self.seal(mac)
        tag = self.tag or (0, 0)
        return torch.tensor(
            [self.step, self.crc, self.n_skel, self.n_askel, self.n_abuf, self.nbytes, self.src, self.nonce, *tag],
            dtype=torch.int64,
        )

    @staticmethod
    def empty_from(header: list[int]) -> Frozen:
        step, crc, n_skel, n_askel, n_abuf, nbytes, src, nonce, *tag = header
        if min(step, n_skel, n_askel, n_abuf, nbytes, src) < 0 or body_at(n_skel, n_askel, n_abuf) > nbytes:
            raise ValueError(f"a snapshot header that describes no snapshot: {header[:7]}")
        f = Frozen(step, src, n_skel, n_askel, n_abuf, torch.empty(nbytes, dtype=torch.uint8), crc)
        f.nonce, f.tag = nonce, (tuple(tag) if any(tag) else None)
        return f

    def thaw(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state and aux, free of the payload (small tensors of one dtype and shape may
        share one new storage, as views of it)."""
        state, aux, _, _ = self.thaw_into(None)
        return state, aux

    def thaw_into(
        self, live: Any, landing: LandingPool | None = None
    ) -> tuple[dict[str, Any], dict[str, Any], int, int]:
        """`thaw`, the state's tensors copied straight into the live ones of the same path
        (no second copy of the state in memory, none made on the GPU by the restore), those
        with no live home into `landing`'s where it has them; -> (state, aux, bytes written
        in place, bytes written into `landing`'s)."""
        self.wait_ready()
        p = self.payload
        a = self.n_skel
        b = a + self.n_askel
        c = b + self.n_abuf
        skel, askel = bytes(p[:a].numpy().tobytes()), bytes(p[a:b].numpy().tobytes())
        state, written, landed = unpack_into(skel, p[body_at(self.n_skel, self.n_askel, self.n_abuf) :], live, landing)
        return state, unflatten(askel, p[b:c]), written, landed


@dataclass
class SnapshotStore:
    """This rank's own snapshots and the copies it holds for others, by step."""

    rank: int
    own: dict[int, Frozen] = field(default_factory=dict)
    held: dict[int, dict[int, Frozen]] = field(default_factory=dict)  # src -> step -> copy
    corrupt_held: bool = False  # fault injection: this node's memory flips a byte in what it holds
    corrupt_found: list[tuple[int, int]] = field(default_factory=list)  # (src, step) dropped as corrupt
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def keep_own(self, f: Frozen) -> None:
        with self._lock:
            self.own[f.step] = f

    def keep_held(self, f: Frozen) -> None:
        with self._lock:
            if self.corrupt_held:
                _flip(f)
            self.held.setdefault(f.src, {})[f.step] = f

    def corrupt_now(self) -> None:
        """Fault injection: from now on every copy held here (and each already held) is damaged."""
        with self._lock:
            if self.corrupt_held:
                return
            self.corrupt_held = True
            for by_step in self.held.values():
                for f in by_step.values():
                    _flip(f)

    def confirm(self, step: int) -> None:
        """Every rank has snapshot `step` complete: older ones are no longer needed."""
        with self._lock:
            self.own = {s: f for s, f in self.own.items() if s >= step}
            self.held = {src: {s: f for s, f in v.items() if s >= step} for src, v in self.held.items()}

    def drop_after(self, step: int) -> None:
        """After a rollback to `step`, newer snapshots describe a future that is recomputed."""
        with self._lock:
            self.own = {s: f for s, f in self.own.items() if s <= step}
            self.held = {src: {s: f for s, f in v.items() if s <= step} for src, v in self.held.items()}

    def forget(self, src: int, step: int) -> None:
        with self._lock:
            self.held.get(src, {}).pop(step, None)
            if src == self.rank:
                self.own.pop(step, None)

    def get(self, src: int, step: int) -> Frozen | None:
        with self._lock:
            if src == self.rank:
                return self.own.get(step)
            return self.held.get(src, {}).get(step)

    def verified_inventory(self) -> list[tuple[int, int]]:
        """(src, step) of every complete copy whose CRC still matches; damaged ones are
        dropped. Own copies the exchange thread has not sealed yet are sealed here: they
        never left this process's memory."""
        out: list[tuple[int, int]] = []
        with self._lock:
            for f in self.own.values():
                f.seal()
            for src, by_step in [(self.rank, self.own), *self.held.items()]:
                for step, f in list(by_step.items()):
                    if f.crc >= 0 and f.verify():
                        out.append((src, step))
                    else:
                        del by_step[step]
                        self.corrupt_found.append((src, step))
        return out

    @property
    def nbytes(self) -> int:
        with self._lock:
            own = sum(f.nbytes for f in self.own.values())
            return own + sum(f.nbytes for v in self.held.values() for f in v.values())


def _flip(f: Frozen) -> None:
    if f.nbytes:
        i = f.nbytes // 2
        f.payload[i] = f.payload[i] ^ 0x5A


@dataclass(frozen=True)
class Fetch:
    """`holder` sends its copy of `src`'s snapshot at the rollback step to `src`."""

    holder: int
    src: int


class NoSnapshot(RuntimeError):
    """No step has a complete snapshot of every rank left: the in-memory state is gone."""


def plan_rollback(
    inventory: dict[int, list[tuple[int, int]]], world_size: int, at_most: int
) -> tuple[int, list[Fetch]]:
    """The newest step <= `at_most` at which every rank's snapshot survives somewhere,
    and who sends each rank that does not hold its own. `inventory[holder]` lists the
    (src, step) copies that holder verified. Pure: every rank computes the same plan.

    Senders are spread over the holders: the ranks with the fewest holders choose first,
    each the least-loaded of its holders (a greedy matching; it only affects speed)."""
    where: dict[tuple[int, int], list[int]] = {}
    for holder in sorted(inventory):
        for src, step in inventory[holder]:
            where.setdefault((src, step), []).append(holder)
    steps = sorted({step for (_, step) in where if step <= at_most}, reverse=True)
    for step in steps:
        if all((r, step) in where for r in range(world_size)):
            behind = [r for r in range(world_size) if r not in where[(r, step)]]
            load: dict[int, int] = {}
            chosen: dict[int, int] = {}
            for r in sorted(behind, key=lambda r: (len(where[(r, step)]), r)):
                h = min(where[(r, step)], key=lambda x: (load.get(x, 0), x))
                load[h] = load.get(h, 0) + 1
                chosen[r] = h
            return step, [Fetch(chosen[r], r) for r in sorted(chosen)]
    lost = sorted({r for r in range(world_size) if not any((r, s) in where for s in steps)})
    if lost:
        why = f"no copy left of rank(s) {lost[:8]}{'...' if len(lost) > 8 else ''}"
    else:
        why = "every rank has some copy, but no step is complete for all of them"
    raise NoSnapshot(f"no snapshot step is complete for every rank ({why})")


@dataclass
class SnapshotStats:
    taken: int = 0
    skipped: int = 0  # due, but the previous exchange was not confirmed yet
    capture_s: float = 0.0
    last_capture_s: float = 0.0
    started: float = field(default_factory=time.monotonic)
