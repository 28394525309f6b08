"""The job's event stream: one JSON line per event with monotonic and wall time.

Listeners (``EventLog.listeners``) see every record as it is written: `resil-run`'s
live status line is one. They run on the controller's thread, so they must be cheap;
one that raises is dropped (with a log line) rather than allowed to stop the job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resild.events.schema import EventName

log = logging.getLogger("resild.events")

Listener = Callable[[dict[str, Any]], None]

# `progress` events are throttled: enough points to draw committed step against wall
# time and to show steps/s live, without one line per step (100k ranks x 10 steps/s).
PROGRESS_INTERVAL_S = 0.5
RECENT_PROGRESS = 20_000  # progress events kept in memory: hours of step rate, bounded


class EventLog:
    def __init__(self, path: Path | None = None, progress_interval_s: float = PROGRESS_INTERVAL_S) -> None:
        self.records: list[dict[str, Any]] = []
        self.recent_progress: deque[dict[str, Any]] = deque(maxlen=RECENT_PROGRESS)
        self.listeners: list[Listener] = []
        self.progress_interval_s = progress_interval_s
        self._last_progress: float | None = None
        self._f = open(path, "a", encoding="utf-8") if path is not None else None

    def emit(self, event: EventName | str, **fields: Any) -> dict[str, Any]:
        """Write one event. `event` is an EventName (a peer's "worker.<name>" events are
        plain strings); the record holds the plain value, as files always have."""
        if isinstance(event, EventName):
            event = event.value
        now = time.monotonic()
        src = fields.pop("t_mono", None)
        rec = {"event": event, "t_mono": src or now, "t_wall": time.time(), **fields}
        if src is not None and src != now:
            # The sender's clock (a worker's CLOCK_MONOTONIC: another host under Slurm);
            # t_log is when this log saw it, on the same clock as every controller event.
            rec["t_log"] = now
        if event != EventName.PROGRESS:
            self.records.append(rec)
        else:  # weeks of 2/s would fill memory: the file has them all, memory the latest
            self.recent_progress.append(rec)
        if self._f is not None:
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._f.flush()
        for fn in list(self.listeners):
            try:
                fn(rec)
            except Exception as e:  # a display bug must never take the job down
                log.warning("event listener %r failed and was removed: %r", fn, e)
                self.listeners.remove(fn)
        return rec

    def progress(self, step: int, epoch: int) -> dict[str, Any] | None:
        """A `progress` event (committed step, epoch), at most once per progress_interval_s."""
        now = time.monotonic()
        if self._last_progress is not None and now - self._last_progress < self.progress_interval_s:
            return None
        self._last_progress = now
        return self.emit(EventName.PROGRESS, step=step, epoch=epoch)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of a log that may still be written to (or whose writer was killed
    mid-line): what parses, in file order. `resild.report.goodput.load_events` is the strict
    reader for finished logs."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if (rec := _record(line)) is not None:
            out.append(rec)
    return out


def _record(line: str | bytes) -> dict[str, Any] | None:
    """One line's event, or None for a line that is not one (torn, foreign, not JSON)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class EventTail:
    """The records appended to an event file since the last poll: complete lines only, each
    line once, so following a week-long log costs what was added. A line still being written
    (no newline yet) or not yet visible (NUL bytes: a shared filesystem may show the new size
    before the data) is read again at the next poll. A missing file is empty; a file that
    shrank or was replaced is read from its start."""

    def __init__(self, path: Path, from_end: bool = False) -> None:
        """from_end: only what is appended from now on."""
        self.path = path
        self._offset = 0  # end of the last line handed out
        self._file_id: tuple[int, int] | None = None
        if from_end:
            try:
                st = path.stat()
                self._offset, self._file_id = st.st_size, (st.st_dev, st.st_ino)
            except OSError:
                pass

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != self._file_id or st.st_size < self._offset:
                    self._offset, self._file_id = 0, (st.st_dev, st.st_ino)
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        out: list[dict[str, Any]] = []
        *lines, _partial = data.split(b"\n")
        for line in lines:
            if b"\0" in line:
                break  # not written yet as far as we can see: from here again next time
            self._offset += len(line) + 1
            if (rec := _record(line)) is not None:
                out.append(rec)
        return out
