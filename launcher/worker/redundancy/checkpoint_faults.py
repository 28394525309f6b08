"""A fault-injecting stand-in for the disk checkpoint's storage (tests and drills only).

`RESILD_CHECKPOINT_FAULTS` (in the workers' environment) lists faults, comma-separated,
each acted out once, at the first save of a step at or after STEP (a save deferred past
its due step still meets its fault; every rank saves the same steps):

    POINT:MODE@STEP[:rRANK][:NODE]     e.g. write:fail@20:r1, plan:hang@40, write:die@20:r1:node1

POINT: plan (DCP's local planning), write (the rank's data file), finish (rank 0 writes
DCP's metadata), complete (rank 0 writes COMPLETE). MODE: fail (raises OSError, as a full
or failed disk would), hang (never returns, as a dead file server), slowS (sleeps S
seconds), outlive (holds until this rank's checkpoint group has been formed again by a
recovery, then goes on: a write still running across a recovery), die (the rank's process
is SIGKILLed there: a node lost mid-save). Without :rRANK the fault hits every rank; with
:NODE only the ranks of that node (`local-` may be left out), not a spare taking them
over. Production never sets the variable (disk_checkpoint's writer calls no fault then).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from resild.wire import env as resild_env

ENV = resild_env.CHECKPOINT_FAULTS.name
POINTS = ("plan", "write", "finish", "complete")
_SPEC = re.compile(
    r"(?P<point>[a-z]+):(?P<mode>fail|hang|outlive|die|slow(?P<slow>[0-9]{1,4}(?:\.[0-9]{1,3})?))"
    r"@(?P<step>[0-9]{1,12})(?::r(?P<rank>[0-9]{1,7}))?(?::(?P<node>[A-Za-z][A-Za-z0-9_.-]{0,127}))?"
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
    node: str | None = None


def parse(text: str) -> list[CheckpointFault]:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = _SPEC.fullmatch(part)
        if m is None or m["point"] not in POINTS:
            raise CheckpointFaultError(
                f"bad {ENV} entry {part[:80]!r}: expected POINT:MODE@STEP[:rRANK][:NODE] with POINT one of "
                f"{', '.join(POINTS)} and MODE fail, hang, outlive, die or slowS (e.g. write:slow2.5@20:r1)"
            )
        mode = "slow" if m["slow"] else m["mode"]
        rank = int(m["rank"]) if m["rank"] is not None else None
        slow_s = float(m["slow"] or 0.0)
        out.append(CheckpointFault(m["point"], mode, int(m["step"]), rank, slow_s, m["node"]))
    return out


def from_env() -> list[CheckpointFault]:
    return parse(os.environ.get(ENV, ""))


class Faults:
    """The faults of one rank; `hit(point, step, reformed)` acts out those due, once each."""

    def __init__(self, faults: list[CheckpointFault], rank: int, node: str = "") -> None:
        def mine(f: CheckpointFault) -> bool:
            return (f.rank is None or f.rank == rank) and f.node in (None, node, node.removeprefix("local-"))

        self.faults = [f for f in faults if mine(f)]

    def hit(self, point: str, step: int, reformed: Callable[[], bool]) -> None:
        for f in list(self.faults):
            if f.point != point or step < f.step:
                continue
            self.faults.remove(f)
            if f.mode == "fail":
                raise OSError(errno.EIO, f"injected checkpoint fault {point}:fail@{f.step} (saving step {step})")
            if f.mode == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            if f.mode == "hang":
                threading.Event().wait()  # forever: the thread is a daemon
            if f.mode == "slow":
                time.sleep(f.slow_s)
            if f.mode == "outlive":
                deadline = time.monotonic() + OUTLIVE_CAP_S
                while not reformed() and time.monotonic() < deadline:
                    time.sleep(0.01)
