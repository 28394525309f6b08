"""For test scripts that wrap a training loop: run SCRIPT with a hook called before each step
that `job.steps` yields (tests/held_train.py holds steps, tests/reset_train.py cuts
connections), the loop itself unchanged, so its result matches its reference."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import launcher


def run_with_step_hook(argv: list[str], hook: Callable[[Any, int], None]) -> None:
    """Run argv[0] as __main__ with `argv` as sys.argv; `hook(job, step)` before each step."""
    sys.argv = argv
    init = launcher.init

    def hooked_init(*args: Any, **kwargs: Any) -> Any:
        job = init(*args, **kwargs)
        steps = job.steps

        def hooked_steps(total: int) -> Iterator[int]:
            for step in steps(total):
                hook(job, step)
                yield step

        job.steps = hooked_steps
        return job

    launcher.init = hooked_init
    runpy.run_path(argv[0], run_name="__main__")
