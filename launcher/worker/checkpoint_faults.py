"""A fault-injecting stand-in for the disk checkpoint's storage (tests and drills only).

`RESILD_CHECKPOINT_FAULTS` (in the workers' environment) lists faults, comma-separated:

    POINT:MODE@STEP[:rRANK]     e.g. write:fail@20:r1, plan:hang@40, complete:slow2.5@60

POINT: plan (DCP's local planning), write (the rank's data file), finish (rank 0 writes
DCP's metadata), complete (rank 0 writes COMPLETE). MODE: fail (raises OSError, as a full
or failed disk would), hang (never returns, as a dead file server), slowS (sleeps S
seconds), outlive (holds until this rank's checkpoint group has been formed again by a
recovery, then goes on: a write still running across a recovery). Without :rRANK the
fault hits every rank. Production never sets the variable and uses DCP's writer as is.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter

from resild.wire import env as resild_env

ENV = resild_env.CHECKPOINT_FAULTS.name
POINTS = ("plan", "write", "finish", "complete")
_SPEC = re.compile(
    r"(?P<point>[a-z]+):(?P<mode>fail|hang|outlive|slow(?P<slow>[0-9]{1,4}(?:\.[0-9]{1,3})?))"
    r"@(?P<step>[0-9]{1,12})(?::r(?P<rank>[0-9]{1,7}))?"
)
OUTLIVE_CAP_S = 120.0  # an `outlive` fault with no recovery coming goes on after this


class CheckpointFaultError(ValueError):
    pass


@dataclass(frozen=True)
class CheckpointFault:
    point: str
    mode: str  # fail | hang | slow | outlive
    step: int
    rank: int | None = None
    slow_s: float = 0.0


def parse(text: str) -> list[CheckpointFault]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _SPEC.fullmatch(part)
        if m is None or m["point"] not in POINTS:
            raise CheckpointFaultError(
                f"bad {ENV} entry {part[:80]!r}: expected POINT:MODE@STEP[:rRANK] with POINT one of "
                f"{', '.join(POINTS)} and MODE fail, hang, outlive or slowS (e.g. write:slow2.5@20:r1)"
            )
        mode = "slow" if m["slow"] else m["mode"]
        rank = int(m["rank"]) if m["rank"] is not None else None
        out.append(CheckpointFault(m["point"], mode, int(m["step"]), rank, float(m["slow"] or 0.0)))
    return out


def from_env() -> list[CheckpointFault]:
    return parse(os.environ.get(ENV, ""))


class Faults:
    """The faults of one rank; `hit(point, step, reformed)` acts out any that match."""

    def __init__(self, faults: list[CheckpointFault], rank: int) -> None:
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]

    def hit(self, point: str, step: int, reformed: Callable[[], bool]) -> None:
        for f in self.faults:
            if f.point != point or f.step != step:
                continue
            if f.mode == "fail":
                raise OSError(errno.EIO, f"injected checkpoint fault {point}:fail@{step}")
            if f.mode == "hang":
                threading.Event().wait()  # forever: the thread is a daemon
            if f.mode == "slow":
                time.sleep(f.slow_s)
            if f.mode == "outlive":
                deadline = time.monotonic() + OUTLIVE_CAP_S
                while not reformed() and time.monotonic() < deadline:
                    time.sleep(0.01)


class FaultyWriter(FileSystemWriter):
    """DCP's file system writer with `Faults` at its planning, data and metadata points."""

    def __init__(self, path: Path, faults: Faults, step: int, reformed: Callable[[], bool], **kw: Any) -> None:
        super().__init__(path, **kw)
        self._faults, self._step, self._reformed = faults, step, reformed

    def prepare_local_plan(self, plan: Any) -> Any:
        self._faults.hit("plan", self._step, self._reformed)
        return super().prepare_local_plan(plan)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._faults.hit("write", self._step, self._reformed)
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        self._faults.hit("finish", self._step, self._reformed)
        super().finish(metadata, results)
