"""Xid lines from the kernel log: parsing, and a follower for /dev/kmsg.

NVML events and the kernel log each miss things the other sees (an Xid that
kills the NVML event path still reaches the log), so the daemon watches both.
Reading /dev/kmsg needs CAP_SYSLOG when kernel.dmesg_restrict=1.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# "NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
# Older drivers omit "PCI:". Anything may precede it: "3,1234,5678901,-;" from
# /dev/kmsg, "[ 123.456]" from dmesg, a syslog prefix.
_XID_RE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\)"
    r":[ \t]*(?P<xid>[0-9]{1,6})(?![0-9])(?:,[ \t]*(?P<msg>.*))?",
    re.ASCII,
)
MAX_LINE = 4096  # a kernel record is at most ~1 KiB; anything longer is cut before parsing
MAX_PARTIAL = 1 << 16


@dataclass(frozen=True)
class KmsgXid:
    pci_bus_id: str  # as logged, e.g. "0000:05:00"
    xid: int
    message: str  # the rest of the line after the code


def parse_xid_line(line: str) -> KmsgXid | None:
    """The Xid in one kernel-log line, or None if it is not an NVRM Xid line."""
    m = _XID_RE.search(line[:MAX_LINE])
    if m is None:
        return None
    return KmsgXid(pci_bus_id=m["bus"], xid=int(m["xid"]), message=(m["msg"] or "").strip())


def pci_bus_key(bus_id: str) -> str:
    """Canonical "domain:bus:device" (lowercase, 8-digit domain, no function).

    Matches kmsg's "0000:05:00" with NVML's "00000000:05:00.0".
    """
    parts = bus_id.strip().lower().split(".")[0].split(":")
    if len(parts) == 2:  # "bus:device" without domain
        parts = ["0", *parts]
    if len(parts) != 3:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, dev = (int(p, 16) for p in parts)
    return f"{domain:08x}:{bus:02x}:{dev:02x}"


class KmsgFollower:
    """Follows /dev/kmsg (or a plain file, for tests) from its current end.

    Calls ``on_xid`` for every Xid line, from a daemon thread. Nothing raises
    out of the thread: open/read errors and exceptions from the callbacks go to
    ``on_error`` (or the log), and the follower keeps trying — reopening after
    ``retry_interval_s`` — until ``stop()``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_xid: Callable[[KmsgXid], None],
        on_error: Callable[[BaseException], None] | None = None,
        poll_interval_s: float = 0.1,
        retry_interval_s: float = 5.0,
    ) -> None:
        self.path = os.fspath(path)
        self._on_xid = on_xid
        self._on_error = on_error
        self._poll_interval_s = poll_interval_s
        self._retry_interval_s = retry_interval_s
        self._stop = threading.Event()
        self._opened = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KmsgFollower already started")
        self._thread = threading.Thread(target=self._run, name=f"kmsg-follow:{self.path}", daemon=True)
        self._thread.start()

    def wait_opened(self, timeout_s: float) -> bool:
        """True once the file is open and positioned at its end (lines after this are seen)."""
        return self._opened.wait(timeout_s)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- thread -------------------------------------------------------------

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            try:
                # Only the first open skips to the end: after a reopen, lines
                # written meanwhile to a plain file are still read.
                self._follow(skip_to_end=first)
                first = False
            except Exception as e:
                self._report(e)
                self._stop.wait(self._retry_interval_s)

    def _follow(self, skip_to_end: bool) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                self._follow_kmsg(fd)
            else:
                self._follow_file(fd, skip_to_end)
        finally:
            os.close(fd)

    def _follow_kmsg(self, fd: int) -> None:
        # /dev/kmsg: SEEK_END skips the existing ring buffer; each read()
        # returns exactly one record; poll() says when a new one is there.
        os.lseek(fd, 0, os.SEEK_END)
        self._opened.set()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(int(self._poll_interval_s * 1000)):
                continue
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten before we read them
                    log.warning("kmsg: records lost (ring buffer overrun)")
                    continue
                raise
            # A record is "prefix;message\n" plus optional " KEY=value" lines.
            self._line(record.decode("utf-8", "replace").split("\n", 1)[0])

    def _follow_file(self, fd: int, skip_to_end: bool) -> None:
        pos = os.lseek(fd, 0, os.SEEK_END) if skip_to_end else 0
        os.lseek(fd, pos, os.SEEK_SET)
        self._opened.set()
        partial = b""
        while not self._stop.is_set():
            chunk = os.read(fd, 65536)
            if not chunk:
                st_size = os.stat(self.path).st_size
                if st_size < pos or os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                    return  # truncated or replaced: reopen from the start
                self._stop.wait(self._poll_interval_s)
                continue
            pos += len(chunk)
            *lines, partial = (partial + chunk).split(b"\n")
            partial = partial[-MAX_PARTIAL:]  # a newline-less flood must not grow without bound
            for raw in lines:
                self._line(raw.decode("utf-8", "replace"))

    def _line(self, line: str) -> None:
        try:
            xid = parse_xid_line(line)
        except Exception as e:
            self._report(e)
            return
        if xid is None:
            return
        try:
            self._on_xid(xid)
        except Exception as e:
            self._report(e)

    def _report(self, exc: BaseException) -> None:
        if self._on_error is None:
            log.warning("kmsg follower %s: %s", self.path, exc)
            return
        try:
            self._on_error(exc)
        except Exception:
            log.exception("kmsg follower %s: on_error raised", self.path)
