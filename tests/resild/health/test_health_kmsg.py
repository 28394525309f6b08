from __future__ import annotations

import os
import queue
import time
from pathlib import Path

import pytest

from resild.health.kmsg import KmsgFollower, KmsgXid, parse_xid_line, pci_bus_key

pytestmark = pytest.mark.timeout(30)

NEW = "NVRM: Xid (PCI:0000:05:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OLD = "NVRM: Xid (0000:05:00): 79, pid=1234, name=python, GPU has fallen off the bus."


@pytest.mark.parametrize(
    "line",
    [
        NEW,
        OLD,
        "3,1234,5678901,-;" + NEW,  # /dev/kmsg record
        "4,998,123456789,-;" + OLD,
        "[ 1234.567890] " + NEW,  # dmesg
        "Jun 01 12:00:00 node17 kernel: " + NEW,  # journal / syslog
    ],
)
def test_parse_both_formats(line: str) -> None:
    x = parse_xid_line(line)
    assert x is not None
    assert x.pci_bus_id == "0000:05:00"
    assert x.xid == 79
    assert x.message.endswith("GPU has fallen off the bus.")
    assert x.message.startswith("pid=")


def test_parse_variants() -> None:
    x = parse_xid_line("NVRM: Xid (PCI:0000:b7:00): 119, Timeout after 6s of waiting for RPC response from GPU1 GSP!")
    assert x == KmsgXid("0000:b7:00", 119, "Timeout after 6s of waiting for RPC response from GPU1 GSP!")
    assert parse_xid_line("NVRM: Xid (PCI:0000:3b:00): 13") == KmsgXid("0000:3b:00", 13, "")
    assert parse_xid_line("NVRM: Xid (PCI:00000000:3B:00.0): 48, DBE") == KmsgXid("00000000:3B:00.0", 48, "DBE")


@pytest.mark.parametrize(
    "line",
    [
        "",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "NVRM: GPU at PCI:0000:05:00: GPU-1234",
        "usb 1-1: new high-speed USB device",
        "NVRM: Xid (PCI:0000:05:00): not-a-number",
    ],
)
def test_non_xid_lines(line: str) -> None:
    assert parse_xid_line(line) is None


def test_pci_bus_key_matches_nvml_and_kmsg_forms() -> None:
    assert pci_bus_key("0000:05:00") == pci_bus_key("00000000:05:00.0") == "00000000:05:00"
    assert pci_bus_key("0000:B7:00") == pci_bus_key("00000000:b7:00.0")
    assert pci_bus_key("05:00") == "00000000:05:00"
    with pytest.raises(ValueError):
        pci_bus_key("garbage")


def _follower(path: Path, **kw):
    got: queue.Queue[KmsgXid] = queue.Queue()
    errors: queue.Queue[BaseException] = queue.Queue()
    f = KmsgFollower(path, got.put, on_error=errors.put, poll_interval_s=0.01, retry_interval_s=0.05, **kw)
    return f, got, errors


def test_follower_reads_from_the_end_of_a_file(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("3,1,1,-;" + NEW.replace("79", "13") + "\n")  # before start: not reported
    f, got, errors = _follower(log)
    f.start()
    try:
        assert f.wait_opened(2.0)
        with log.open("a") as w:
            w.write("6,2,2,-;usb 1-1: whatever\n")
            w.write("3,3,3,-;" + NEW + "\n")
            w.write("3,4,4,-;NVRM: Xid (0000:")  # a partial line ...
            w.flush()
            assert got.get(timeout=2.0) == KmsgXid("0000:05:00", 79, NEW.split("79, ")[1])
            w.write("06:00): 48, DBE\n")  # ... completed later
        assert got.get(timeout=2.0) == KmsgXid("0000:06:00", 48, "DBE")
        assert got.empty() and errors.empty()
    finally:
        f.stop()
    assert not f.running


def test_follower_survives_callback_errors_rotation_and_late_file(tmp_path: Path) -> None:
    log = tmp_path / "late.log"  # does not exist yet
    calls: list[KmsgXid] = []
    errors: queue.Queue[BaseException] = queue.Queue()

    def on_xid(x: KmsgXid) -> None:
        calls.append(x)
        if x.xid == 13:
            raise RuntimeError("callback bug")

    f = KmsgFollower(log, on_xid, on_error=errors.put, poll_interval_s=0.01, retry_interval_s=0.05)
    f.start()
    try:
        assert isinstance(errors.get(timeout=2.0), FileNotFoundError)
        log.write_text("")
        assert f.wait_opened(2.0)
        with log.open("a") as w:
            w.write(OLD.replace("79", "13") + "\n")
        assert isinstance(errors.get(timeout=2.0), RuntimeError)  # reported, not raised
        rotated = tmp_path / "late.log.new"  # rotated: new file, read from its start
        rotated.write_text(NEW + "\n")
        os.replace(rotated, log)
        deadline = time.monotonic() + 2.0
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [c.xid for c in calls] == [13, 79]
        assert f.running
    finally:
        f.stop()
    assert not f.running
