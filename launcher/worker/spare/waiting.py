"""A spare's wait for ranks, and what it does meanwhile (warm up; see `warmup`).

The controller's WELCOME names a worker's role: a spare's worker fetches the job's
warm-up recipe and warms up at once, an active one never; a worker told nothing (an
older controller) still without ranks after FETCH_RECIPE_AFTER_S is taken for a spare.
`compiled_graphs` counts what torch.compile compiled in this process, for the report
of a spare's first step after taking over.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import resild.wire.env as resild_env
from launcher.worker.links.controller import ControlLink
from launcher.worker.spare.warmup import SpareWarmup
from resild.membership import Membership, NodeRole

FETCH_RECIPE_AFTER_S = 2.0  # told no role (an older controller), a worker without ranks this long is taken for a spare


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's counters; 0 if it never ran)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warmup_plan(role: Any, env: Mapping[str, str]) -> tuple[bool, float]:
    """-> (warm up while waiting for ranks, after how long without them), from the role the
    controller's WELCOME gave this worker's node when it registered: a spare's worker at
    once, an active one never; told nothing (a controller before stop 30), a worker still
    without ranks after FETCH_RECIPE_AFTER_S. RESILD_SPARE_WARMUP=0: never. Pure."""
    if role == NodeRole.ACTIVE.value or env.get(resild_env.SPARE_WARMUP.name, resild_env.SPARE_WARMUP.default) == "0":
        return False, FETCH_RECIPE_AFTER_S
    return True, 0.0 if role == NodeRole.SPARE.value else FETCH_RECIPE_AFTER_S


def wait_for_ranks(
    link: ControlLink,
    node: str,
    local_rank: int,
    check_shutdown: Callable[[], None],
    warmup: SpareWarmup | None = None,
    fetch_after_s: float = FETCH_RECIPE_AFTER_S,
) -> tuple[Membership, int]:
    """A spare waits for a membership that gives it a rank; epochs that leave it out
    are taken and passed over. The rank is read from the membership taken: a newer
    one may replace the pending one between a look and the take. A worker still
    without ranks after `fetch_after_s` (0 for a worker the controller's welcome called
    a spare's) fetches the job's warm-up recipe and warms up here, stopping as soon as a
    membership or the end of the job arrives. An active worker is given no warm-up."""
    t0 = time.monotonic()

    def news() -> bool:
        return link.pending is not None or link.shutdown is not None

    def warm_ready() -> bool:
        return warmup is not None and warmup.ready()

    while True:
        wait_s = 3600.0
        if warmup is not None and not warmup.started:
            wait_s = max(0.0, t0 + fetch_after_s - time.monotonic())
        link.wait(lambda: news() or warm_ready(), wait_s)
        if warmup is not None and not warmup.started and not news() and time.monotonic() - t0 >= fetch_after_s:
            warmup.start()
        if warmup is not None and warmup.ready() and not news():
            warmup.run(news)
            continue
        check_shutdown()
        m = link.take()
        if m is None:
            continue
        rank = m.rank_of(node, local_rank)
        if rank is not None:
            if warmup is not None:
                warmup.stop()
            return m, rank
