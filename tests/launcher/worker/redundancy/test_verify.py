"""--verify-every: which steps are computed twice, the two passes' comparison, and the
vote's verdict (pure), with an injected emitter and stop."""

from __future__ import annotations

from typing import Any, NoReturn

import pytest
import torch

from launcher.worker.redundancy.verify import StepVerifier, Verdict, grad_digest, judge


def test_a_few_ranks_that_differ_are_faulty_most_mean_the_loop_does_not_reproduce() -> None:
    assert judge(0, 8) is Verdict.COMMIT
    assert judge(1, 8) is Verdict.FAULTY and judge(4, 8) is Verdict.FAULTY
    assert judge(5, 8) is Verdict.NOT_REPRODUCIBLE and judge(8, 8) is Verdict.NOT_REPRODUCIBLE
    assert judge(1, 2) is Verdict.FAULTY and judge(2, 2) is Verdict.NOT_REPRODUCIBLE


class Stop(Exception):
    pass


def verifier(every: int = 3, world: int = 4) -> tuple[StepVerifier, list[tuple[Any, dict[str, Any]]]]:
    said: list[tuple[Any, dict[str, Any]]] = []

    def fatal(why: str) -> NoReturn:
        raise Stop(why)

    return StepVerifier(every, 1, world, lambda name, **f: said.append((name, f)), fatal), said


def test_every_kth_step_is_computed_twice_and_compared() -> None:
    v, _ = verifier(every=3)
    assert [s for s in range(9) if v.due(s)] == [2, 5, 8]  # the 3rd, 6th, 9th commit
    assert not StepVerifier(0, 0, 2, print, print).due(0)  # type: ignore[arg-type]
    assert v.again(2, 111)  # first pass: compute it again
    assert not v.again(2, 111) and v.vote_flag() == 0 and v.verified == 1  # alike
    assert v.again(5, 7) and not v.again(5, 8) and v.vote_flag() == 1  # differed


def test_a_first_pass_is_never_compared_across_a_recovery_or_another_step() -> None:
    v, _ = verifier()
    assert v.again(2, 1)
    v.reset()
    assert v.again(2, 2)  # a first pass again, not a mismatch
    assert v.again(5, 3)  # another step: a first pass too
    assert not v.again(5, 3) and v.vote_flag() == 0


def test_a_rejected_step_names_the_rank_that_differed_and_spares_the_others() -> None:
    v, said = verifier(world=4)
    v.again(2, 1), v.again(2, 9)
    with pytest.raises(RuntimeError, match="rank 1 computed step 2 twice .* faulty device"):
        v.rejected(2, 1)
    assert said == [("gradients_differed", {"step": 2, "ranks": 1})] and v.vote_flag() == 0
    other, said_other = verifier(world=4)
    other.again(2, 1), other.again(2, 1)
    other.rejected(2, 1)  # a rank that computed alike: it waits for the recovery
    assert said_other == []


def test_a_step_most_ranks_cannot_reproduce_stops_the_job() -> None:
    v, _ = verifier(world=4)
    with pytest.raises(Stop, match="3 of 4 ranks computed step 2 twice .* does not reproduce"):
        v.rejected(2, 3)


def test_the_digest_sees_one_changed_gradient_and_a_missing_one() -> None:
    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    d = grad_digest(m)
    assert grad_digest(m) == d
    m.bias.grad[0] += 1.0  # type: ignore[index]
    assert grad_digest(m) != d
    m.bias.grad = None
    assert grad_digest(m) not in (d, 0)
