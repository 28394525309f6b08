"""Two replicas without a majority: who leaves first, and what the recomputation beside a
spare settles (pure)."""

from __future__ import annotations

from launcher.worker.redundancy.arbitration import Outcome, Pending, arbitrate, suspects_of


def test_the_higher_rank_of_each_pair_leaves_first_and_larger_groups_are_not_pairs() -> None:
    assert suspects_of(((0, 4), (6, 2))) == ((4, 0), (6, 2))
    assert suspects_of(((0, 1, 2, 3),)) == ()  # four with two against two: not a pair to arbitrate


P = Pending(25, (10, 20, 30, 30), ((1, 0),))  # ranks 0 and 1 disagreed at step 25; 2 and 3 agreed


def test_the_pair_agreeing_again_settles_it() -> None:
    # the other reproduced its own first result: the suspect alone drifted (replaced already)
    assert arbitrate(P, [10, 10, 31, 31]) == Outcome((1,), ())
    # a transient fault whose gradients reached both: the pair agrees on a third value
    assert arbitrate(P, [11, 11, 31, 31]) == Outcome((), ())


def test_the_other_repeating_its_disagreement_beside_a_fresh_spare_leaves_and_every_rank_rolls_back() -> None:
    assert arbitrate(P, [10, 99, 31, 31]) == Outcome((0,), (0,), rollback=True)


def test_a_step_that_gives_a_new_answer_each_time_stops_the_job() -> None:
    out = arbitrate(P, [12, 13, 31, 31])
    assert out.stop and "does not reproduce" in out.stop and "[0, 1]" in out.stop and not out.leave
