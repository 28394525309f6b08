"""The controller's own errors: a bug of ours is never a node's failure, nor the job's end.

An exception in a message handler drops that message (its sender gets an ERROR); one in a
step of the tick costs that step this round (the other steps, the leases first, still run).
Each is logged with its traceback, emitted as a `controller_error` event and journaled (a
`controller_error` record, which restore ignores) — once per place per `report_s`, with
the count since the last report, so that an error on every tick (50 a second) or every
message of a flood never becomes a flood of log lines, events and journal writes.

What the loop does when the tick keeps failing is `policy.give_up_verdict`'s decision
(loop.py); nothing here sends anything to a node.
"""

from __future__ import annotations

import logging
import time
import traceback
from dataclasses import dataclass
from typing import Any

from resild.controller.journal import Journal
from resild.controller.records import ControllerError
from resild.events.log import EventLog
from resild.events.schema import EventName

log = logging.getLogger("resild.controller")

ERROR_REPORT_S = 10.0  # one report (log + event + journal record) per place this often


@dataclass
class _Place:
    reported_s: float
    since: int = 0  # errors here since that report


class InternalErrors:
    def __init__(self, events: EventLog, journal: Journal, report_s: float = ERROR_REPORT_S) -> None:
        self.events, self.journal, self.report_s = events, journal, report_s
        self.total = 0
        self._places: dict[str, _Place] = {}

    def record(self, where: str, e: BaseException, now: float, *, fatal: bool = False, **context: Any) -> None:
        """An exception of ours at `where` ("handler:heartbeat", "tick:leases", "loop"):
        reported (at most once per place per report_s; always when fatal), never raised."""
        self.total += 1
        place = self._places.get(where)
        if place is not None and now - place.reported_s < self.report_s and not fatal:
            place.since += 1
            return
        count = 1 + (place.since if place is not None else 0)
        self._places[where] = _Place(now)
        error = repr(e)[:500]
        log.error(
            "controller error in %s%s (%d since the last report)%s",
            where,
            " (giving up)" if fatal else "",
            count,
            "".join(f", {k}={v!r}" for k, v in context.items()),
            exc_info=e,
        )
        tb = "".join(traceback.format_exception(e))
        try:
            self.events.emit(
                EventName.CONTROLLER_ERROR,
                where=where,
                error=error,
                count=count,
                fatal=fatal,
                traceback=tb[-2000:],
                **context,
            )
        except Exception:  # reporting must not become the next error
            log.exception("could not emit the controller error as an event")
        try:
            self.journal.append(ControllerError(where, error, count, fatal, time.time()))
        except Exception:
            log.exception("could not journal the controller error")
