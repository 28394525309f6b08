"""Write-ahead journal: a decision is on disk (fsynced) before it is acted on,
so a restarted controller can rebuild membership and never re-admit a fenced node.

A journal that cannot be written (disk full, I/O error, the file gone) must not
turn a recoverable fault into a failed job: `append` logs loudly, emits a
`journal_error` event (once per failure streak, when an event log is attached),
keeps `healthy`/`last_error`/`errors` for the controller's status, and returns
False; the job goes on without durability until a write succeeds again.

A *replicated* journal (standby controllers) is different: its write is what proves
this replica still leads. A record the replicas did not commit is a decision this
replica may no longer make (it was deposed while stalled, or lost its majority), so
the controller carries out nothing of it (`Effects`) and the policy decides again at
the next tick, here or at the new leader.

Records are typed (resild/controller/records.py makes their JSON); `write` takes a
record's JSON form as it is (a standby's replicated copy, agreed on by Raft).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any, Protocol

from resild.controller.records import Record
from resild.events.schema import EventName

log = logging.getLogger("resild.journal")


class _Events(Protocol):
    def emit(self, event: str, **fields: Any) -> Any: ...


class Journal:
    replicated = False  # True: a failed write means "not (provably) the leader": act on nothing

    def __init__(self, path: Path | None, events: _Events | None = None) -> None:
        self.path = path
        self.events = events
        self.errors = 0  # failed appends so far
        self.last_error: str | None = None
        self.healthy = True  # False while writes fail (the status flag)
        self._f: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def attach(self, events: _Events) -> None:
        """Journal failures also go to this event log (as `journal_error`)."""
        self.events = events

    def status(self) -> dict[str, Any]:
        return {
            "path": str(self.path) if self.path else None,
            "healthy": self.healthy,
            "errors": self.errors,
            "last_error": self.last_error,
        }

    def append(self, record: Record) -> bool:
        """True once the record is durable; False (never an exception) when it is not."""
        return self.write(record.to_dict())

    def write(self, record: dict[str, Any]) -> bool:
        """`append` for a record already in its JSON form."""
        if self._f is None:
            return self.path is None
        try:
            line = json.dumps(record, separators=(",", ":")) + "\n"
            self._f.write(line)
            self._f.flush()
            os.fsync(self._f.fileno())
        except (OSError, ValueError, TypeError) as e:
            self._failed(e, record)
            return False
        if not self.healthy:
            log.warning("journal %s writable again after %d failed write(s)", self.path, self.errors)
            self.healthy = True
        return True

    def _failed(self, e: Exception, record: dict[str, Any]) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"
        first = self.healthy
        self.healthy = False
        log.error(
            "JOURNAL WRITE FAILED (%s) for %s: %s; the job goes on, but this decision is not durable",
            self.path,
            record.get("action", "a record"),
            self.last_error,
        )
        # A failed write may leave a partial line: start the next record on a fresh line so
        # that a reader loses at most this torn record.
        # (A replicated journal has no file: a Raft commit timeout lands here too, and an
        # assert on the file crashed the leader mid-decision.)
        if self._f is not None:
            try:
                self._f.write("\n")
                self._f.flush()
            except (OSError, ValueError):
                pass
        if first and self.events is not None:
            try:
                self.events.emit(
                    EventName.JOURNAL_ERROR, path=str(self.path), error=self.last_error, errors=self.errors
                )
            except Exception:
                log.exception("could not record the journal error as an event")

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as e:  # close flushes: a full disk can fail here too
                log.error("journal %s: close failed: %s", self.path, e)
            self._f = None
