"""The last state the replicas agreed on, kept to roll back to after a divergence.

Fingerprints compared every M commits catch a rank whose state drifted, but only at
the compare: the odd rank's gradients of the steps in between were averaged into
every replica, so the majority's state is no longer the failure-free one. Each rank
therefore keeps, in host memory, its own copy of its state at the last step whose
fingerprints agreed (replicas exist, so nothing is exchanged). On a divergence every
rank returns to that step at the recovery that replaces the odd rank's node, and the
steps since are redone.

    compare clean at step S  -> every rank copies its state (one host copy, reused)
    compare odd at step D    -> every rank marks D (StepState.diverged_at); the odd leave
    recovery's agreement     -> `plan` (pure, the same on every rank): back to S
    every holder of S        -> writes its copy into its live state, checks it against the
                                fingerprint the replicas agreed on at S (a copy that fails
                                is dropped: that rank receives S from a replica instead)

A divergence with no agreed copy to return to (found at the first compare) leaves the
state as the majority holds it: `plan` says why it cannot be vouched for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from launcher.worker.redundancy.device_stager import DeviceStager
from launcher.worker.redundancy.fingerprint import fingerprint
from launcher.worker.redundancy.snapshot_store import Frozen, Layout
from launcher.worker.step_state import NONE

# Columns of the recovery's agreement rows (StepState.agreement_row)
STEP, DIVERGED_AT, AGREED = 0, 3, 4


@dataclass(frozen=True)
class Rollback:
    """The recovery's answer to a divergence: return to `step`, or (None) stay where the
    majority is and say why that state cannot be vouched for."""

    diverged_at: int  # the step whose compare found the divergence
    step: int | None  # the step every rank returns to
    unvouched: str = ""  # why nothing was rolled back

    @property
    def redone(self) -> int:
        return self.diverged_at - self.step if self.step is not None else 0


def plan(rows: list[list[int]]) -> Rollback | None:
    """Pure. `rows[r]`: rank r's agreement row. None: no rank saw a divergence since its
    last recovery. Else back to the newest agreed step any holder kept (older than the
    divergence); holders without a copy of it receive it from a replica."""
    found = [r[DIVERGED_AT] for r in rows if len(r) > AGREED]
    diverged_at = max(found, default=0)
    if diverged_at <= 0:
        return None
    kept = [r[AGREED] for r in rows if r[STEP] != NONE and 0 <= r[AGREED] < diverged_at]
    if not kept:
        return Rollback(
            diverged_at,
            None,
            f"replicas diverged at step {diverged_at} before any fingerprint compare had agreed, so no agreed "
            "state was kept: the faulty rank's gradients since the job's start are in every replica",
        )
    return Rollback(diverged_at, max(kept))


class AgreedCopy:
    """This rank's state at the last step whose fingerprints agreed: one host buffer,
    written again at every agreeing compare. A GPU rank's is staged like a snapshot
    (device_stager: pinned, on a side stream while the next step's forward and backward
    run; the next optimizer step waits for it in `before_write`)."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.stager = DeviceStager(device) if device.type == "cuda" else None
        self.frozen: Frozen | None = None
        self.value = 0  # the fingerprint the replicas agreed on: what a restored copy must show
        self.capture_s = 0.0  # time spent copying, for bench/
        self.kept = 0

    @property
    def step(self) -> int:
        return self.frozen.step if self.frozen is not None else NONE

    @property
    def nbytes(self) -> int:
        return self.frozen.nbytes if self.frozen is not None else 0

    def keep(self, step: int, value: int, state: dict[str, Any], aux: dict[str, Any]) -> None:
        t0 = time.monotonic()
        if self.stager is not None:  # one pinned buffer, reused (busy: none, the old copy is superseded)
            self.frozen, self.value = self.stager.capture(step, self.rank, state, aux, set()), value
            self.capture_s += time.monotonic() - t0
            self.kept += 1
            return
        lay = Layout.of(state, aux)
        old = self.frozen.payload if self.frozen is not None else None
        if old is not None and old.numel() == lay.nbytes:
            payload = old
        else:
            self.frozen = None  # the old buffer goes before the new one is made: never two
            payload = torch.empty(lay.nbytes, dtype=torch.uint8)
        lay.write_head(payload)
        lay.write_body(payload)
        self.frozen, self.value = lay.frozen(step, self.rank, payload), value
        self.capture_s += time.monotonic() - t0
        self.kept += 1

    def before_write(self) -> None:
        """The live state is about to change: a staged copy must have read it first."""
        if self.stager is not None:
            self.stager.before_write()

    def restore_into(self, live: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
        """Write the copy into `live` (the rank's state view) in place; -> (state, aux,
        bytes written in place)."""
        assert self.frozen is not None
        state, aux, written, _ = self.frozen.thaw_into(live)
        return state, aux, written

    def matches(self, state: dict[str, Any]) -> bool:
        """Is `state` (restored from the copy) the state the replicas agreed on?"""
        return fingerprint(state) == self.value

    def drop(self) -> None:
        self.frozen = None
