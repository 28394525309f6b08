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

from resild.events.schema import RECOVERY_EVENTS, EventName

log = logging.getLogger("resild.events")

Listener = Callable[[dict[str, Any]], None]

# `progress` events are throttled: enough points to draw committed step against wall
# time and to show steps/s live, without one line per step (100k ranks x 10 steps/s).
PROGRESS_INTERVAL_S = 0.5
RECENT_PROGRESS = 20_000  # progress events kept in memory: hours of step rate, bounded

# The other events kept in memory (for resil-run's end-of-run summary; the file has them all).
# What the summary reads (recoveries.py: failures, fences, epochs, resumes) is kept apart from
# the rest (peers' own events, registrations, done ranks), so that a flood of peer events can
# never push a failure out of the summary. Over a cap, events are counted, not kept.
MAX_RECORDS = 50_000
MAX_OTHER_RECORDS = 20_000
MAX_RECORD_BYTES = 64 << 20  # the kept records' JSON, all together: a few large events cannot fill memory
SUMMARY_EVENTS = RECOVERY_EVENTS | {
    EventName.NODE_SUSPECT,
    EventName.JOB_FINISHED,
    EventName.JOB_FAILED,
    EventName.CONTROLLER_RESTORED,
    EventName.JOURNAL_ERROR,
    EventName.ROLLED_BACK,
    EventName.SNAPSHOT_CORRUPT,
    EventName.REPLICA_DIVERGED,
    EventName.STATE_UNVOUCHED,
    EventName.GRADIENTS_DIFFERED,
    EventName.REPLICA_ARBITRATED,
    EventName.STRAGGLER,
}


class EventLog:
    def __init__(
        self,
        path: Path | None = None,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        max_records: int = MAX_RECORDS,
        max_other_records: int = MAX_OTHER_RECORDS,
    ) -> None:
        self.records: list[dict[str, Any]] = []
        self.max_records, self.max_other_records = max_records, max_other_records
        self._kept = {True: 0, False: 0}  # records kept: summary events, others
        self._kept_bytes = 0
        self.records_dropped = 0  # events written (or tried) but not kept in memory: over a cap
        self.dropped_lines = 0  # events that could not be written (a full disk, an I/O error)
        self.path = path
        self.recent_progress: deque[dict[str, Any]] = deque(maxlen=RECENT_PROGRESS)
        self.listeners: list[Listener] = []
        self.progress_interval_s = progress_interval_s
        self._last_progress: float | None = None
        # Unbuffered: one write per line, so a failed write loses that line and nothing
        # buffered behind it (a full disk must not leave a growing buffer either).
        self._f = open(path, "ab", buffering=0) if path is not None else None

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
        line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
        if event != EventName.PROGRESS:
            self._keep(event, rec, len(line))
        else:  # weeks of 2/s would fill memory: the file has them all, memory the latest
            self.recent_progress.append(rec)
        if self._f is not None:
            self._write(line)
        for fn in list(self.listeners):
            try:
                fn(rec)
            except Exception as e:  # a display bug must never take the job down
                log.warning("event listener %r failed and was removed: %r", fn, e)
                self.listeners.remove(fn)
        return rec

    def _keep(self, event: str, rec: dict[str, Any], size: int) -> None:
        summary = event in SUMMARY_EVENTS
        cap = self.max_records if summary else self.max_other_records
        if self._kept[summary] >= cap or self._kept_bytes + size > MAX_RECORD_BYTES:
            self.records_dropped += 1
            return
        self._kept[summary] += 1
        self._kept_bytes += size
        self.records.append(rec)

    def _write(self, line: bytes) -> None:
        """One line to the file. A write error (a full disk, a dead NFS server) never
        reaches the caller: the controller's loop must go on deciding, so the line is
        counted, said once, and the next one tried (the disk may have room again)."""
        assert self._f is not None
        try:
            view = memoryview(line)
            while view:
                n = self._f.write(view)
                if not n:
                    raise OSError("short write")
                view = view[n:]
        except (OSError, ValueError) as e:  # ValueError: the file was closed under us
            if not self.dropped_lines:
                log.error("could not write to the events file %s (%r): events are being dropped", self.path, e)
            self.dropped_lines += 1

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
