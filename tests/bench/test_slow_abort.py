"""bench/slow_abort.py's summary: medians per delay and the ratio against delay 0 of the same round."""

from __future__ import annotations

from bench.slow_abort import summarize


def test_the_ratio_is_taken_within_each_round_against_delay_zero() -> None:
    rounds = [
        {0.0: {"total_s": 1.0, "recover_s": 0.3}, 3.0: {"total_s": 1.2, "recover_s": 0.4}},
        {0.0: {"total_s": 2.0, "recover_s": 0.5}, 3.0: {"total_s": 2.2, "recover_s": 0.6}},
        {0.0: {"total_s": 1.0, "recover_s": 0.2}, 3.0: {"total_s": None, "recover_s": None}},  # a failed run
    ]
    s = summarize(rounds)
    assert s["0.0"]["ratio_total"] == 1.0
    assert abs(s["3.0"]["ratio_total"] - (1.2 + 1.1) / 2) < 1e-9
    assert abs(s["3.0"]["total_s"] - 1.7) < 1e-9 and s["3.0"]["abort_wait_s"] is None
