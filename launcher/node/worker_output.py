"""A worker's stderr, passed through the node process: forwarded as it comes, its tail kept.

A rank whose collective is mismatched is usually killed from inside the backend (gloo:
`terminate called after throwing ... op.preamble.length <= op.nbytes ... Is there a
distributed collective mismatch in your code?`, then SIGABRT). Python never sees it, so
only the process's own output says why it died. The node process reads each worker's
stderr through a pipe, writes every byte on to its own stderr at once (nothing is held
back or reordered within a worker), keeps the last TAIL_BYTES, and when the worker
exits looks there for a mismatch (`mismatch_line`): the controller then stops the job
with that line instead of replacing a healthy node (resild.controller.policy).
"""

from __future__ import annotations

import os
import threading

TAIL_BYTES = 16 << 10
MAX_LINE = 400
# What backends print when ranks' collectives do not match (gloo's enforce messages; torch's
# own wording), lower case.
MARKERS = (
    "is there a distributed collective mismatch",
    "op.preamble.length <= op.nbytes",
    "collective mismatch",
)


def mismatch_line(text: str) -> str | None:
    """The line of `text` (a worker's last output) that says its collectives were
    mismatched, trimmed; None if no line does. Pure."""
    for line in reversed(text.splitlines()):
        low = line.lower()
        if any(m in low for m in MARKERS):
            line = line.strip()
            return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."
    return None


class OutputTail:
    """Forward everything read from `src` (a pipe's read end, owned from now on) to the
    file descriptor `dst`, keeping the last TAIL_BYTES; in a daemon thread until EOF."""

    def __init__(self, src: int, dst: int = 2) -> None:
        self.src, self.dst = src, dst
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="resild-worker-stderr", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.src, 1 << 16):
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(self.dst, view) :]
                    except BlockingIOError:
                        continue
                    except OSError:
                        break  # our own stderr is gone: keep reading, so the worker never blocks
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-TAIL_BYTES]
        except OSError:
            pass
        finally:
            os.close(self.src)

    def text(self, wait_s: float = 0.0) -> str:
        """The tail so far, after waiting up to `wait_s` for EOF (a child of the worker may
        hold the pipe open past its exit)."""
        if wait_s > 0:
            self._thread.join(wait_s)
        with self._lock:
            return self._tail.decode("utf-8", "replace")
