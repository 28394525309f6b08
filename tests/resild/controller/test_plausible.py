from __future__ import annotations

from resild.controller.plausible import corroborated


def test_one_nodes_claim_alone_never_raises_the_jobs_committed_step() -> None:
    assert corroborated({"a": 9, "b": 2**53 - 1}, ["a", "b"]) == 9
    assert corroborated({"a": 9, "b": 2**53 - 1, "c": 8}, ["a", "b", "c"]) == 9
    assert corroborated({"a": 9}, ["a", "b"]) == 0  # b has not reported (a spare that just took over)
    assert corroborated({"a": 9, "gone": 50}, ["a", "b"]) == 0  # a fenced node's claims are not the epoch's


def test_a_job_of_one_node_is_its_own_witness() -> None:
    assert corroborated({"a": 12}, ["a"]) == 12
    assert corroborated({}, []) == 0
