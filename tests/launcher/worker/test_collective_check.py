"""Ranks that issue different collectives (launcher/worker/collective_check.py): the
description of a collective, the digest the vote carries, the judgement every rank makes
from the same rows, and the check's life over a step (a fake exchange, no processes)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from launcher.worker.collective_check import (
    MAX_DIGEST_WORLD,
    CollectiveCheck,
    Desc,
    agree,
    digest,
    group_kind,
    judge,
    vote_terms,
)

pytestmark = pytest.mark.timeout(60)

KINDS = {Desc.of("barrier", [], k).kind: group_kind(k) for k in ("world", "resild-shard-0", "resild-tp-0")}


@pytest.mark.parametrize(
    "label,kind",
    [("world", "world"), ("world~2", "world"), ("resild-shard-3", "shard"), ("resild-replicate-12~1", "replicate")],
)
def test_a_groups_kind_is_the_same_on_every_rank(label: str, kind: str) -> None:
    assert group_kind(label) == kind


def test_a_description_is_the_op_dtype_and_size_of_what_this_rank_sends() -> None:
    a = Desc.of("allreduce", [torch.zeros(3, 4)], "resild-shard-0")
    assert a == Desc.of("allreduce", [torch.ones(12)], "resild-shard-1")  # another group of the same kind
    assert a != Desc.of("allreduce", [torch.zeros(3, 4, dtype=torch.float64)], "resild-shard-0")
    assert a != Desc.of("allreduce", [torch.zeros(11)], "resild-shard-0")
    assert a != Desc.of("allreduce", [torch.zeros(12)], "resild-tp-0")
    assert a != Desc.of("broadcast", [torch.zeros(12)], "resild-shard-0")
    # uneven splits differ by design: their sizes are not compared
    assert Desc.of("all_to_all_single", torch.zeros(5), "world") == Desc.of(
        "all_to_all_single", torch.zeros(9), "world"
    )
    assert Desc.of("reduce_scatter", [[torch.zeros(2), torch.zeros(2)]], "world").numel == 4
    assert Desc.of("barrier", [], "world").text(KINDS) == "barrier(no tensor) on the world group"
    assert a.text(KINDS) == "allreduce(float32, 12 elements) on the shard group"
    d, fresh = Desc.from_row(a.row(True))
    assert d == a and fresh


def test_the_vote_agrees_exactly_when_every_rank_voted_the_same_terms() -> None:
    def summed(*per_rank: list[int]) -> list[int]:
        return [sum(x) for x in zip(*per_rank)]

    t = vote_terms(7, 0xDEADBEEF, 4)
    assert len(t) == 6 and t[0] == 7 and t[1] == 49
    assert agree(summed(t, t, t, t), 4)
    assert not agree(summed(t, t, t, vote_terms(6, 0xDEADBEEF, 4)), 4)
    assert not agree(summed(t, t, t, vote_terms(7, 0xDEADBEEE, 4)), 4)
    # a mean that one rank happens to hold does not fool it: digests 1, 2, 3 sum as 2, 2, 2 do
    sums = summed(vote_terms(0, 1, 3), vote_terms(0, 2, 3), vote_terms(0, 3, 3))
    assert sums[2] == 6 and not agree(sums, 3)
    assert vote_terms(7, 1, MAX_DIGEST_WORLD + 1) == [0] * 6  # squares could overflow: not compared


def test_the_squares_fit_in_int64_at_the_largest_world_compared() -> None:
    w = MAX_DIGEST_WORLD
    worst = vote_terms(1 << 20, 0xFFFFFFFF, w)
    assert all(w * (w * v) < 1 << 63 for v in worst[1::2])  # W * sum(v^2) over W ranks
    assert all((w * v) ** 2 < 1 << 63 for v in worst[0::2])


def test_the_digest_follows_order_and_content() -> None:
    a, b = Desc.of("allreduce", [torch.zeros(2)], "world"), Desc.of("allreduce", [torch.zeros(3)], "world")
    assert digest(digest(0, a), b) != digest(digest(0, b), a)
    assert digest(digest(0, a), b) == digest(digest(0, a), b)


def rows(*descs: tuple[Desc, bool]) -> list[list[int]]:
    return [d.row(f) for d, f in descs]


NORM = Desc.of("allreduce", [torch.zeros(1)], "resild-shard-0")
VOTE = Desc.of("allreduce", [torch.zeros(8, dtype=torch.int64)], "world")


def test_every_rank_agreeing_passes() -> None:
    assert judge(rows((NORM, False), (NORM, True)), True, 3, 0, KINDS, "x") == judge([], False, 3, 0, KINDS, "x")
    assert not judge(rows((NORM, False), (NORM, True)), False, 3, 0, KINDS, "x").stop


def test_a_newcomer_that_differs_from_the_ranks_that_ran_from_the_start_stops_the_job() -> None:
    v = judge(rows((VOTE, True), (VOTE, True), (NORM, False), (NORM, False)), False, 8, 20, KINDS, "after a recovery")
    assert v.stop and not v.asymmetric
    assert v.line.startswith("collective mismatch in step 8 (after a recovery), collective #21 of the step: ")
    assert "rank 0-1 (a process that joined after the job began) issued allreduce(int64, 8 elements) on the world" in (
        v.line
    )
    assert "while rank 2-3 issued allreduce(float32, 1 element) on the shard group" in v.line
    assert "\n" not in v.line


def test_ranks_that_ran_from_the_start_differing_is_by_design_unless_strict() -> None:
    r = rows((NORM, False), (VOTE, False), (NORM, True))
    assert judge(r, False, 1, 0, KINDS, "x").asymmetric
    strict = judge(r, True, 1, 0, KINDS, "x")
    assert strict.stop and "rank 1 issued allreduce(int64" in strict.line and "while rank 0, 2 issued" in strict.line
    # no rank that ran from the start (all replaced): nothing to hold a newcomer to
    assert judge(rows((NORM, True), (VOTE, True)), False, 1, 0, KINDS, "x").asymmetric


class Ring:
    """A fake world: every rank's check, exchanging through one another in lock-step."""

    def __init__(self, fresh: list[bool], always: bool = False) -> None:
        self.stopped: list[str] = []
        self.checks = [CollectiveCheck(len(fresh), f, lambda: 5, self.stop, always) for f in fresh]
        for c in self.checks:
            c.name_group("world")
            c.name_group("resild-shard-0")
            c.exchange = lambda row: [row]

    def stop(self, line: str) -> None:
        self.stopped.append(line)

    def issue(self, per_rank: list[tuple[str, Any, str]]) -> None:
        """Each rank issues its collective; the exchange is judged once all rows are in."""
        all_rows = [Desc.of(op, ins, label).row(c.fresh) for c, (op, ins, label) in zip(self.checks, per_rank)]
        for c, (op, ins, label) in zip(self.checks, per_rank):
            c.exchange = lambda row, all_rows=all_rows: all_rows
            c.before(op, ins, label)


def test_unarmed_a_check_only_counts_and_the_vote_arms_it_when_ranks_disagreed() -> None:
    ring = Ring([False, False])
    calls = []
    for c in ring.checks:
        c.exchange = lambda row: calls.append(row)  # never called unarmed
    ring.checks[0].before("allreduce", [torch.zeros(2)], "world")
    ring.checks[1].before("allreduce", [torch.zeros(3)], "world")
    assert calls == [] and [c.count for c in ring.checks] == [1, 1]
    terms = [c.vote_terms() for c in ring.checks]
    sums = [a + b for a, b in zip(*terms)]
    for c in ring.checks:
        c.voted(sums)
    assert all(c.armed and c.count == 0 and c.digest == 0 for c in ring.checks)
    same = [2 * x for x in ring.checks[0].vote_terms()]  # both ranks the same (nothing issued)
    for c in ring.checks:
        c.voted(same)
    assert not any(c.armed for c in ring.checks)


def test_armed_after_a_recovery_a_newcomers_different_collective_stops_the_job() -> None:
    ring = Ring([True, False, False])
    for c in ring.checks:
        c.arm("the first step after a recovery")
    same = ("allreduce", [torch.zeros(1)], "resild-shard-0")
    ring.issue([same, same, same])
    assert ring.stopped == []
    ring.issue([("allreduce", [torch.zeros(8, dtype=torch.int64)], "world"), same, same])
    assert len(ring.stopped) == 3 and len(set(ring.stopped)) == 1  # every rank: the same line
    assert "collective #2 of the step: rank 0 (a process that joined" in ring.stopped[0]
    assert "step 5 (the first step after a recovery)" in ring.stopped[0]


def test_ranks_that_differ_by_design_turn_the_check_off_for_good() -> None:
    ring = Ring([False, False])
    for c in ring.checks:
        c.arm("x")
    ring.issue([("allreduce", [torch.zeros(1)], "world"), ("allreduce", [torch.zeros(2)], "world")])
    assert ring.stopped == [] and not any(c.armed or c.symmetric for c in ring.checks)
    for c in ring.checks:
        c.arm("y")  # the next recovery: stays off
        c.voted([1, 1, 0, 0, 0, 0])  # a disagreeing vote: stays off
    assert not any(c.armed for c in ring.checks)


def test_the_debug_mode_checks_every_step_and_any_difference_stops() -> None:
    ring = Ring([False, False], always=True)
    assert all(c.armed for c in ring.checks)
    for c in ring.checks:
        c.voted([0] * 6)
    assert all(c.armed for c in ring.checks)
    ring.issue([("allreduce", [torch.zeros(1)], "world"), ("broadcast", [torch.zeros(1)], "world")])
    assert len(ring.stopped) == 2 and "RESILD_CHECK_COLLECTIVES=1" in ring.stopped[0]


def test_the_checks_own_exchange_is_not_checked_and_a_failed_epoch_judges_nothing() -> None:
    c = CollectiveCheck(2, False, lambda: 0, lambda line: pytest.fail(line))
    c.arm("x")
    seen = []

    def ex(row: list[int]) -> None:
        c.before("allgather", [torch.zeros(10)], "world")  # as the world group's own all-gather would
        seen.append(row)
        return None  # the epoch failed meanwhile

    c.exchange = ex
    c.before("allreduce", [torch.zeros(1)], "world")
    assert len(seen) == 1 and c.count == 1


def test_every_collective_the_group_names_is_known_and_an_unknown_one_is_still_described() -> None:
    import re
    from pathlib import Path

    import launcher.worker.torch_private as tp
    from launcher.worker.collective_check import OPS

    named = set(re.findall(r'name="(\w+)"', Path(tp.__file__).read_text()))
    named |= set(re.findall(r'^\s+"(\w+_coalesced|reduce_scatter_single)",$', Path(tp.__file__).read_text(), re.M))
    assert named and named <= set(OPS), named - set(OPS)
    for op, n in itertools.product(OPS, (0, 3)):
        Desc.of(op, [torch.zeros(n)], "world")
    assert Desc.of("a_future_op", [], "world").text(KINDS).startswith("op -1(")
