"""Small process helpers: parent-death signal, exit-status text."""

from __future__ import annotations

import signal

from resild.procutil import die_with_parent  # noqa: F401 (launcher's processes use it from here)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"
