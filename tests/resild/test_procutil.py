from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
