"""State transport: moves a rank's training state from healthy replicas to the
ranks behind, over the epoch's communicator (torchft's CheckpointTransport is
the shape: the recovery sequence only says who sends what to whom).

Per receiver: the source of part 0 sends a header, the JSON skeletons and the
aux buffer (RNG, extra); every source sends its disjoint slice of the flat
replicated buffer, straight into the receiver's buffer, all in flight at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from launcher.worker.replica_map import Transfer, slice_bounds
from launcher.worker.state_codec import checksum, flatten, unflatten

H_TAG, SKEL_TAG, ASKEL_TAG, ABUF_TAG, SLICE_TAG, SUM_TAG = 1, 2, 3, 4, 5, 6


@dataclass(frozen=True)
class Received:
    state: dict[str, Any]
    aux: dict[str, Any]
    nbytes: int
    sources: list[int]
    seconds: float
    damaged: tuple[int, ...] = ()  # sources whose bytes failed their checksum (the state is not usable)


class StateTransport(Protocol):
    def exchange(
        self, plan: list[Transfer], me: int, snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    ) -> Received | None:
        """Send what `plan` asks of `me` and receive what it gives `me`."""


class P2PTransport:
    """Point-to-point over a backend group; `wait(work)` waits while watching
    for a newer epoch (and raises out of the exchange when one comes)."""

    def __init__(self, pg: Any, device: torch.device, wait: Callable[[Any], None]) -> None:
        self.pg, self.device, self.wait = pg, device, wait

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def exchange(
        self, plan: list[Transfer], me: int, snapshot: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    ) -> Received | None:
        sends = [t for t in plan if t.src == me]
        recvs = sorted((t for t in plan if t.dst == me), key=lambda t: t.part)
        works: list[Any] = []
        keep: list[torch.Tensor] = []  # send buffers must outlive their works
        if sends:
            state, aux = snapshot()
            skel, buf = flatten(state, self.device)
            askel, abuf = flatten(aux, self.device)
            buf, abuf = self._dev(buf), self._dev(abuf)
            skel_t = self._dev(torch.frombuffer(bytearray(skel), dtype=torch.uint8))
            askel_t = self._dev(torch.frombuffer(bytearray(askel), dtype=torch.uint8))
            header = self._dev(
                torch.tensor(
                    [len(skel), buf.numel(), len(askel), abuf.numel(), checksum(torch.cat([skel_t, askel_t, abuf]))],
                    dtype=torch.int64,
                )
            )
            keep += [buf, abuf, skel_t, askel_t, header]
            for t in sends:
                if t.part == 0:
                    works += [
                        self.pg.send([header], t.dst, H_TAG),
                        self.pg.send([skel_t], t.dst, SKEL_TAG),
                        self.pg.send([askel_t], t.dst, ASKEL_TAG),
                    ]
                    if abuf.numel():
                        works.append(self.pg.send([abuf], t.dst, ABUF_TAG))
                a, b = slice_bounds(buf.numel(), t.part, t.parts)
                if b > a:
                    s = self._dev(torch.tensor([checksum(buf[a:b])], dtype=torch.int64))
                    keep.append(s)
                    works += [self.pg.send([s], t.dst, SUM_TAG), self.pg.send([buf[a:b]], t.dst, SLICE_TAG)]
        got = self._receive(recvs) if recvs else None
        for w in works:
            self.wait(w)
        return got

    def _receive(self, recvs: list[Transfer]) -> Received:
        t0 = time.monotonic()
        primary = recvs[0].src
        header = self._dev(torch.zeros(5, dtype=torch.int64))
        self.wait(self.pg.recv([header], primary, H_TAG))
        n_skel, n_buf, n_askel, n_abuf, aux_sum = (int(x) for x in header.cpu().tolist())
        skel_t = self._dev(torch.empty(n_skel, dtype=torch.uint8))
        askel_t = self._dev(torch.empty(n_askel, dtype=torch.uint8))
        abuf = self._dev(torch.empty(n_abuf, dtype=torch.uint8))
        buf = self._dev(torch.empty(n_buf, dtype=torch.uint8))
        works = [self.pg.recv([skel_t], primary, SKEL_TAG), self.pg.recv([askel_t], primary, ASKEL_TAG)]
        if n_abuf:
            works.append(self.pg.recv([abuf], primary, ABUF_TAG))
        sums: list[tuple[int, int, int, torch.Tensor]] = []
        for t in recvs:
            a, b = slice_bounds(n_buf, t.part, t.parts)
            if b > a:
                s = self._dev(torch.zeros(1, dtype=torch.int64))
                sums.append((t.src, a, b, s))
                works += [self.pg.recv([s], t.src, SUM_TAG), self.pg.recv([buf[a:b]], t.src, SLICE_TAG)]
        for w in works:
            self.wait(w)
        # Verified before use: a damaged transfer is reported, never loaded.
        damaged = [src for src, a, b, s in sums if checksum(buf[a:b]) != int(s.item())]
        if checksum(torch.cat([skel_t, askel_t, abuf])) != aux_sum:
            damaged.append(primary)
        took = time.monotonic() - t0
        n = n_buf + n_abuf + n_skel + n_askel
        if damaged:
            return Received({}, {}, n, [t.src for t in recvs], took, tuple(sorted(set(damaged))))
        state = unflatten(_bytes(skel_t), buf.cpu())
        aux = unflatten(_bytes(askel_t), abuf.cpu())
        return Received(state, aux, n, [t.src for t in recvs], took)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


def describe(r: Received) -> str:
    mb = r.nbytes / 1e6
    rate = mb / r.seconds if r.seconds > 0 else float("inf")
    return f"{mb:.2f} MB from ranks {r.sources} in {r.seconds:.3f}s ({rate:.0f} MB/s)"


__all__ = ["P2PTransport", "Received", "StateTransport", "describe"]
