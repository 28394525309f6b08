"""examples/train.py held at some steps until the test releases them.

    held_train.py RELEASE HOLD_STEP[,HOLD_STEP...] [SCRIPT.py] [its arguments]

SCRIPT.py: examples/train.py unless named (any loop that calls launcher.init).

A fault the test injects from outside (crash, freeze, a node lost) must land while
the job runs; on a loaded machine a short job can finish first. Every rank waits
before each HOLD_STEP until the file RELEASE-HOLD_STEP exists, so the test injects
the fault, then releases. The training itself is train.py's, unchanged, so the
result matches its reference.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not this file's directory: tests/launcher/ is the tests' package, not resild's

from tests.step_hook import run_with_step_hook  # noqa: E402

# Far beyond any test's release (a Slurm test waits up to 2 x 120 s for a cold spare to be
# admitted and registered); then train on rather than hang. A held job's --hang-timeout must
# exceed it: from the controller's side a held rank is a hung one.
RELEASE_WAIT_S = 240.0


def main() -> None:
    release, holds = sys.argv[1], {int(s) for s in sys.argv[2].split(",")}
    rest = sys.argv[3:]
    script = rest.pop(0) if rest and rest[0].endswith(".py") else str(REPO / "examples" / "train.py")

    def hold(job: object, step: int) -> None:
        deadline = time.monotonic() + RELEASE_WAIT_S
        gate = Path(f"{release}-{step}")
        while step in holds and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    run_with_step_hook([script, *rest], hold)


if __name__ == "__main__":
    main()
