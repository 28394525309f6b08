"""bench/goodput_model.py: the failure-rate fit, the recovery cost and the simulation against
closed-form expectations."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from bench.goodput_model import Inputs, main, mttf_h, poisson_quantile, project, resild_cost, simulate, spare_nodes

pytestmark = pytest.mark.timeout(120)


def test_mttf_goes_through_the_published_points():
    inp = Inputs()
    assert mttf_h(1024, inp) == pytest.approx(7.9)
    assert mttf_h(16384, inp) == pytest.approx(1.8)
    assert mttf_h(16384, replace(inp, mttf_source="llama3")) == pytest.approx(54 * 24 / 419)
    assert mttf_h(32768, replace(inp, mttf_scaling="linear")) == pytest.approx(0.9)


def test_resild_cost_adds_its_components():
    c = resild_cost(16000, Inputs(hang_fraction=0.0))
    assert c.announce_s == pytest.approx(0.05)
    assert c.replay_s == pytest.approx(16 / 25)
    assert c.total_s == pytest.approx(0.55 + 0.02 + 0.05 + 0.005 + 0.5 * 16000 / 16384 + 0.64 + 1.0)


def test_poisson_quantile_and_spares():
    assert poisson_quantile(0.0, 0.99) == 0
    assert poisson_quantile(1.0, 0.5) == 1  # P(0) = 0.37 < 0.5 <= P(<=1) = 0.74
    assert spare_nodes(16384, Inputs(spares=7)) == 7
    assert spare_nodes(16384, Inputs()) == poisson_quantile(24 / 1.8, 0.99)


def test_checkpoint_restart_matches_the_first_order_formula():
    # Rare failures: goodput ~ 1 - W/I - (I/2 + D + R)/M.
    inp = Inputs(days=200, runs=1, ckpt_write_s=30, ckpt_interval_s=600, restart_s=300, ckpt_detect_s=10)
    g = 1024
    m = mttf_h(g, inp) * 3600
    expect = 1 - 30 / 630 - (630 / 2 + 310) / m
    got = [simulate(g, inp, random.Random(i), resild=False).goodput for i in range(10)]
    assert sum(got) / len(got) == pytest.approx(expect, abs=0.006)


def test_resild_with_ample_spares_loses_only_recoveries_and_fallback_checkpoints():
    inp = Inputs(days=100, runs=1, spares=1000, fallback_ckpt_interval_h=6, ckpt_write_s=30)
    g = 16384
    m = mttf_h(g, inp) * 3600
    per = resild_cost(g, inp).total_s
    expect = (1 - per / m) * (6 * 3600) / (6 * 3600 + 30)
    r = simulate(g, inp, random.Random(3), resild=True)
    assert r.exhaustions == 0
    assert r.goodput == pytest.approx(expect, abs=0.001)


def test_no_spares_means_every_failure_restarts():
    inp = Inputs(days=30, runs=1, spares=0)
    r = simulate(16384, inp, random.Random(5), resild=True)
    assert r.exhaustions == r.failures > 0


def test_target_row_and_json(capsys):
    row = project(16384, Inputs(runs=10), resild=True)
    assert row.mttf_h == pytest.approx(1.8) and 0.9 < row.goodput <= 1.0
    assert main(["--gpus", "1024", "--runs", "2", "--days", "5", "--json", "--no-before-fix"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["simulation"] is True and {r["system"] for r in d["rows"]} == {"resild", "checkpoint-restart"}
    assert "Kokolis" in d["sources"]["mttf_source"] and math.isclose(d["inputs"]["restart_s"], 600.0)


def test_a_fixed_pool_runs_dry_and_one_that_refills_does_not():
    inp = Inputs(days=30, runs=1, spares=5, cold_spare_wait_s=600, join_s=15)
    fixed = simulate(16384, inp, random.Random(7), resild=True, pool="fixed")
    refill = simulate(16384, inp, random.Random(7), resild=True, pool="refill")
    # ~400 failures, 5 spares that never come back: dry after every 5 (then requeued with 5 again)
    assert fixed.exhaustions >= fixed.failures // 6 > 0
    assert refill.exhaustions == 0 and refill.goodput > fixed.goodput


def test_shrink_trains_on_slower_instead_of_stopping():
    # no spare at all, and a cold spare takes an hour: every failure shrinks, none restarts
    inp = Inputs(days=30, runs=1, spares=0, cold_spare_wait_s=3600, join_s=0, shrink_group_nodes=8)
    g = 16384
    r = simulate(g, inp, random.Random(11), resild=True, pool="shrink")
    assert r.exhaustions == 0 and r.failures > 0
    # each failure runs one replica group short (8 of 2048 nodes) for about an hour
    lost = r.failures * 3600 * 8 / (g // 8) / (30 * 86400)
    ample = simulate(g, replace(inp, spares=1000), random.Random(11), resild=True, pool="refill")
    assert r.goodput == pytest.approx(ample.goodput - lost, abs=0.002)
    assert simulate(g, inp, random.Random(11), resild=True, pool="refill").exhaustions > 0  # without shrink


def test_the_pool_rows(capsys):
    assert main(["--gpus", "1024", "--runs", "2", "--days", "5", "--json", "--pools", "fixed,refill,shrink"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in d["rows"]][:3] == [
        "resild, fixed pool (today)",
        "resild, refill",
        "resild, refill + shrink",
    ]
    with pytest.raises(SystemExit):
        main(["--pools", "nope"])
