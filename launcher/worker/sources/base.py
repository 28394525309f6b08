"""The restore-source interface: what a source is given and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from resild.events.schema import RestoreSource

if TYPE_CHECKING:
    from launcher.worker.transport.landing_pool import LandingPool
    from launcher.worker.transport.state_transport import Received


# How a job's one-line error ends when no source is left but a restart from disk.
IMPOSSIBLE = ": checkpointless recovery is impossible; restart from a disk checkpoint"


class Unavailable(RuntimeError):
    """This source cannot restore the agreed state; the next source is tried. str(): why,
    as a clause of the job's final one-line error if no source can."""


@dataclass(frozen=True)
class Need:
    """What the recovery's agreement asks of the sources (identical on every rank)."""

    newest: int  # the newest step any rank holds
    floor: int  # the newest step the controller saw committed: below it, the state is lost
    steps: list[int]  # every rank's step once the rollers rolled forward
    landing: LandingPool | None = None  # host memory a spare touched for what has no live home


@dataclass
class Restored:
    """Every rank is at `step`. `got`: what this rank received or thawed (None: its live
    state is that step already); `loaded`: the live objects were loaded in place, with
    nothing left for the commit protocol to resume."""

    step: int
    got: Received | None
    source: RestoreSource
    loaded: bool = False


class StateSource(Protocol):
    """One way to restore the lost state. Every rank calls `restore` with the same `Need`
    and must reach the same outcome (restored or Unavailable), collectively."""

    name: RestoreSource

    def restore(self, need: Need, why: str) -> Restored:
        """-> every rank restored; raises Unavailable(why) when this source cannot. `why`:
        what the sources tried before said ("" for the first)."""
        ...

    def fresh_start(self) -> Restored | None:
        """A job starting at step 0 (a requeued or resubmitted one): state this source can
        resume it from, with no user code; None: nothing (collective, like `restore`)."""
        ...

    def ahead(self) -> None:
        """While a recovery's groups form (nothing is known yet of what will be needed):
        make ready what this rank's part in `restore` may use, off its critical path.
        Local, never collective, and never an error: what it made is checked before use."""
        ...
