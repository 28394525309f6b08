"""A spare's wait for ranks (launcher/worker/spare/waiting.py): it fetches the recipe
and warms up before its ranks come, fetches nothing when given ranks at once, and the
role the controller's welcome gives decides whether and when it warms up. No torch work
runs here: the warm-up is probed (its own tests: test_warmup.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from launcher.worker.spare import recipe as wr
from launcher.worker.spare.waiting import FETCH_RECIPE_AFTER_S, compiled_graphs, wait_for_ranks, warmup_plan
from launcher.worker.spare.warmup import SpareWarmup
from resild.membership import Membership

from .test_warmup import recipe_json

pytestmark = pytest.mark.timeout(60)


# ---- the spare's wait -------------------------------------------------------------------------
class FakeLink:
    def __init__(self) -> None:
        self.pending: Membership | None = None
        self.shutdown: dict[str, Any] | None = None
        self.cond = threading.Condition()

    def wait(self, pred: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + min(timeout_s, 10.0)
        with self.cond:  # polls, as ControlLink.wait does (every 0.5 s there)
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(0.05, left))
            return True

    def take(self) -> Membership | None:
        m, self.pending = self.pending, None
        return m

    def announce(self, m: Membership) -> None:
        with self.cond:
            self.pending = m
            self.cond.notify_all()


class FakeStore:
    def __init__(self, value: str | None) -> None:
        self.value = value

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        if self.value is None:
            raise RuntimeError("timed out")

    def get(self, key: str) -> bytes:
        assert key == wr.RECIPE_KEY and self.value is not None
        return self.value.encode()


def _membership(epoch: int, node_ranks: dict[str, tuple[int, ...]]) -> Membership:
    world = sum(len(r) for r in node_ranks.values())
    return Membership(epoch=epoch, world_size=world, node_ranks=node_ranks)


def test_a_worker_left_waiting_fetches_the_recipe_and_warms_up_before_its_ranks_come() -> None:
    link = FakeLink()
    runs: list[bool] = []

    class Probe(SpareWarmup):
        def run(self, cancelled: Any) -> None:
            runs.append(cancelled())  # no torch work in this test (it runs in pytest's process)
            self._done = True
            link.announce(_membership(2, {"a": (0,), "spare": (1,)}))

    w = Probe(FakeStore(recipe_json([2])), torch.device("cpu"))
    w_started = threading.Event()
    orig_start = w.start

    def start() -> None:
        w_started.set()
        orig_start()

    w.start = start  # type: ignore[method-assign]
    link.announce(_membership(1, {"a": (0,), "b": (1,)}))  # an epoch that leaves "spare" out (passed over)
    m, rank = wait_for_ranks(link, "spare", 0, lambda: None, w, fetch_after_s=0.2)  # type: ignore[arg-type]
    assert (m.epoch, rank) == (2, 1)
    assert w_started.is_set() and runs == [False]


def test_a_worker_given_ranks_at_once_fetches_nothing() -> None:
    link = FakeLink()
    w = SpareWarmup(FakeStore(recipe_json()), torch.device("cpu"))
    link.announce(_membership(1, {"a": (0,), "b": (1,)}))
    m, rank = wait_for_ranks(link, "b", 0, lambda: None, w, fetch_after_s=5.0)  # type: ignore[arg-type]
    assert (m.epoch, rank) == (1, 1) and not w.started


def test_a_worker_told_it_is_a_spare_warms_up_before_any_epoch_comes() -> None:
    """fetch_after_s=0 (the controller's welcome said "spare"): the warm-up starts on the
    first look, with no membership pending, not after a timer."""
    link = FakeLink()
    runs: list[float] = []
    t0 = time.monotonic()

    class Probe(SpareWarmup):
        def run(self, cancelled: Any) -> None:
            runs.append(time.monotonic() - t0)
            self._done = True
            link.announce(_membership(2, {"a": (0,), "spare": (1,)}))

    w = Probe(FakeStore(recipe_json([2])), torch.device("cpu"))
    m, rank = wait_for_ranks(link, "spare", 0, lambda: None, w, fetch_after_s=0.0)  # type: ignore[arg-type]
    assert (m.epoch, rank) == (2, 1)
    assert len(runs) == 1 and runs[0] < 1.0  # the 2 s timer of a worker told nothing is not waited


@pytest.mark.parametrize(
    "role,env,plan",
    [
        ("spare", {}, (True, 0.0)),  # told it is a spare's: warm up at once
        ("active", {}, (False, FETCH_RECIPE_AFTER_S)),  # an active worker never fetches the recipe
        (None, {}, (True, FETCH_RECIPE_AFTER_S)),  # an older controller: the timer, as before
        ("spare", {"RESILD_SPARE_WARMUP": "0"}, (False, FETCH_RECIPE_AFTER_S)),  # turned off
    ],
)
def test_the_welcomes_role_decides_whether_and_when_a_worker_warms_up(
    role: str | None, env: dict[str, str], plan: tuple[bool, float]
) -> None:
    assert warmup_plan(role, env) == plan


def test_compiled_graphs_counts_dynamos_graphs_and_nothing_before_dynamo_loads() -> None:
    import sys

    if "torch._dynamo" not in sys.modules:
        assert compiled_graphs() == 0
    from torch._dynamo.utils import counters

    before = compiled_graphs()
    counters["stats"]["unique_graphs"] += 2
    try:
        assert compiled_graphs() == before + 2
    finally:
        counters["stats"]["unique_graphs"] -= 2
