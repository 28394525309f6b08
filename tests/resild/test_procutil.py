from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from resild.procutil import stop_group

pytestmark = pytest.mark.timeout(60)

# Each writer says 1,000 lines as fast as it can; print() would write each text and its newline
# apart, and writers sharing the pipe then run lines together (seen in a job's stderr).
_WRITER = """
import sys
from resild.procutil import say
tag = sys.argv[1]
for i in range(1000):
    say(f"{tag} line {i:04d} " + "x" * 200)
"""


def test_say_from_three_processes_on_one_pipe() -> None:
    rfd, wfd = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, f"writer{k}"], stderr=wfd, stdout=subprocess.DEVNULL)
        for k in range(3)
    ]
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        out = f.read().decode()
    for p in procs:
        assert p.wait(timeout=30) == 0
    lines = out.splitlines()
    assert len(lines) == 3000
    for ln in lines:
        tag, word, num, xs = ln.split(" ")
        assert tag.startswith("writer") and word == "line" and len(num) == 4 and xs == "x" * 200, ln


def test_stop_group_stops_the_whole_group_and_kills_what_ignores_the_signal() -> None:
    # a leader that ignores SIGTERM and a child of its group: both gone, the leader reaped
    code = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(1.0)
    stop_group(p, signal.SIGTERM, timeout_s=0.5)
    assert p.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10  # the child, orphaned when killed, is reaped by init
    while time.monotonic() < deadline:
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break  # no process of its group is left
        time.sleep(0.05)
    else:
        raise AssertionError("a process of the stopped group is still there")
