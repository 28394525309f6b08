"""The committed floor: the controller's one write into the job's rendezvous keys."""

from __future__ import annotations

from typing import Any

from resild.events.schema import EventName
from resild.wire.store import COMMITTED_KEY


class CommittedFloor:
    """An event listener: publishes, in the rendezvous store, the newest step the
    controller knew to be committed when it decided a failure. A recovery that finds
    no rank at that step has lost every replica of the state: it must stop, not
    restart from step 0."""

    def __init__(self, keys: Any) -> None:
        self.keys = keys  # resild.controller.rendezvous.Rendezvous

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("event") == EventName.FAILURE_DETECTED:
            self.publish(int(rec.get("committed_step") or 0))

    def publish(self, step: int) -> None:
        self.keys.set(COMMITTED_KEY, str(step).encode())
