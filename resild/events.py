"""The job's event stream: one JSON line per event with monotonic and wall time."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    def __init__(self, path: Path | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self._f = open(path, "a", encoding="utf-8") if path is not None else None

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = {"event": event, "t_mono": fields.pop("t_mono", None) or time.monotonic(), "t_wall": time.time(), **fields}
        self.records.append(rec)
        if self._f is not None:
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._f.flush()
        return rec

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
