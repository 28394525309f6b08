"""Write-ahead journal: a decision is on disk (fsynced) before it is acted on,
so a restarted controller can rebuild membership and never re-admit a fenced node."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


class Journal:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(path, "a", encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        if self._f is None:
            return
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def replay(path: Path) -> Iterator[dict[str, Any]]:
    """Records in order; a torn last line (crash mid-write) is ignored."""
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except ValueError:
                break
