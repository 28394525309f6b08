"""bench/pair_proof.py, tiny: one 2-rank group, one proof, one JSON line; bad sizes refused."""

from __future__ import annotations

import json

import pytest

from bench.pair_proof import main


@pytest.mark.timeout(120)
def test_a_tiny_run_prints_the_formation_and_the_proof(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--ranks", "2", "--rounds", "1", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["ranks"] == 2 and row["messages_per_rank"] == 2
    assert row["formation_s"] > 0 and row["proof_s"] > 0 and row["proof_vs_formation"] > 0


def test_a_group_of_one_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--ranks", "1"])
    assert e.value.code == 2 and "--ranks must each be >= 2" in capsys.readouterr().err
