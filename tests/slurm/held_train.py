"""examples/train.py held at one step until the test releases it.

    held_train.py RELEASE_FILE HOLD_STEP [train.py's arguments]

A fault the test injects from outside (crash, freeze) must land while the job
runs; on a loaded machine a short job can finish first. Every rank waits before
HOLD_STEP until RELEASE_FILE exists, so the test injects the fault, then releases.
The training itself is train.py's, unchanged, so the result matches its reference.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import launcher

REPO = Path(__file__).resolve().parents[2]
RELEASE_WAIT_S = 60.0  # far beyond any test's release; then train on rather than hang


def main() -> None:
    release, hold = Path(sys.argv[1]), int(sys.argv[2])
    sys.argv = [str(REPO / "examples" / "train.py"), *sys.argv[3:]]
    init = launcher.init

    def held_init(*args, **kwargs):
        job = init(*args, **kwargs)
        steps = job.steps

        def held_steps(total: int):
            for step in steps(total):
                deadline = time.monotonic() + RELEASE_WAIT_S
                while step == hold and not release.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                yield step

        job.steps = held_steps
        return job

    launcher.init = held_init
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
