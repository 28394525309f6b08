"""examples/train.py whose rank RANK cuts its own data-plane connections once, at STEP of
the first epoch: every node stays alive, and a collective fails (a connection reset).

    reset_train.py STEP RANK [train.py's arguments]

Each established TCP connection of the process that does not go to a controller (the
gloo pairs) is shut down through a duplicate of its descriptor, as a reset on the wire
would end it. The training itself is train.py's, so the result matches its reference.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # not this file's directory: tests/launcher/ is the tests' package, not resild's

from tests.step_hook import run_with_step_hook  # noqa: E402


def cut_data_plane() -> int:
    controllers = {int(ep.rsplit(":", 1)[1]) for ep in os.environ.get("RESILD_CONTROLLER", "").split(",") if ":" in ep}
    cut = 0
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.raddr.port in controllers or c.fd < 0:
            continue
        s = socket.socket(fileno=os.dup(c.fd))
        try:
            s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            pass
        finally:
            s.close()
    return cut


def main() -> None:
    at, rank = int(sys.argv[1]), int(sys.argv[2])

    def cut(job: Any, step: int) -> None:
        if step == at and job.epoch == 1 and job.rank == rank:
            print(f"rank {rank}: cut {cut_data_plane()} connections at step {step}", file=sys.stderr)

    run_with_step_hook([str(REPO / "examples" / "train.py"), *sys.argv[3:]], cut)


if __name__ == "__main__":
    main()
