"""A worker's stderr through the node process (launcher/node/worker_output.py): every byte
forwarded, the tail kept, and a backend's last words about a collective mismatch found
(a real process that writes gloo's message and aborts, as gloo does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from launcher.node.worker_output import MAX_LINE, TAIL_BYTES, OutputTail, mismatch_line

pytestmark = pytest.mark.timeout(60)

GLOO = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
    "op.preamble.length <= op.nbytes. 12 vs 8. Received data size doesn't match expected size. "
    "Is there a distributed collective mismatch in your code?\n"
)


def test_the_mismatch_line_is_found_and_nothing_else_is() -> None:
    line = mismatch_line("step 7\n" + GLOO + "[rank1]: W... some warning\n")
    assert line is not None and line.startswith("what():  [enforce fail") and "12 vs 8" in line
    assert mismatch_line("RuntimeError: CUDA error: an illegal memory access\n") is None
    assert mismatch_line("") is None
    long = mismatch_line("x" * 1000 + " collective mismatch\n")
    assert long is not None and len(long) == MAX_LINE and long.endswith("...")


def test_a_workers_stderr_is_forwarded_whole_and_its_abort_explained() -> None:
    r, w = os.pipe()
    code = (
        f"import os, sys; sys.stderr.write('x' * {TAIL_BYTES * 2} + '\\n'); sys.stderr.write({GLOO!r}); "
        "sys.stderr.flush(); os.abort()"
    )
    out_r, out_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=w)
    os.close(w)
    tail = OutputTail(r, out_w)
    forwarded = bytearray()
    os.set_blocking(out_r, False)
    assert proc.wait(timeout=30) == -signal.SIGABRT
    text = tail.text(wait_s=5.0)
    os.close(out_w)
    while True:
        try:
            chunk = os.read(out_r, 1 << 16)
        except BlockingIOError:
            continue
        if not chunk:
            break
        forwarded += chunk
    os.close(out_r)
    assert len(forwarded) == TAIL_BYTES * 2 + 1 + len(GLOO)  # every byte, in order
    assert forwarded.endswith(GLOO.encode())
    assert len(text) == TAIL_BYTES and text.endswith(GLOO)
    assert "12 vs 8" in (mismatch_line(text) or "")
