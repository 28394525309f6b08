"""The fake NVML's event wait sleeps until the control file changes, as the driver
sleeps until an event: an idle wait must not wake its thread every few milliseconds
(the daemon's event thread runs beside the trainers in the benchmarks), and an event
appended during a wait must still end it at once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resild.health.fakenvml import FakeNvmlControl, fake_nvml_env

CHILD = textwrap.dedent(
    """
    import json, sys, threading, time
    import pynvml

    def switches():
        with open("/proc/thread-self/status") as f:
            return int(next(l for l in f if l.startswith("voluntary_ctxt_switches")).split()[1])

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    s = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, s)
    out = {}
    before = switches()
    t0 = time.monotonic()
    try:
        pynvml.nvmlEventSetWait_v2(s, 1500)
        out["idle"] = "event"
    except pynvml.NVMLError as e:
        out["idle"] = e.value
    out["idle_s"] = time.monotonic() - t0
    out["idle_switches"] = switches() - before

    def write_later():
        time.sleep(0.2)
        with open(sys.argv[1], "a") as f:  # in place, as an operator's echo >> would
            f.write("event 0 xid 79\\n")

    threading.Thread(target=write_later).start()
    t0 = time.monotonic()
    data = pynvml.nvmlEventSetWait_v2(s, 5000)
    out["event_s"] = time.monotonic() - t0
    out["xid"] = int(data.eventData)
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(60)
def test_idle_wait_sleeps_and_an_event_ends_it(fake_nvml_dir: Path, tmp_path: Path) -> None:
    ctl = tmp_path / "nvml.ctl"
    FakeNvmlControl(ctl, gpus=1)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(ctl)],
        env=fake_nvml_env(fake_nvml_dir, ctl),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["idle"] == 10  # NVML_ERROR_TIMEOUT, after the whole timeout
    assert out["idle_s"] >= 1.4
    # Re-reading the file every 10 ms would be ~150 wake-ups; inotify's safety net is 1 s.
    assert out["idle_switches"] < 15, out
    assert out["xid"] == 79
    assert out["event_s"] < 0.9, out  # the write woke it, not the 1 s safety net
