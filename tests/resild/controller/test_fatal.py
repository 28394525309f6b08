"""One node's FATAL alone ends no job (resild.controller.fatal): pure policy, injected clock."""

from __future__ import annotations

from resild.controller.fatal import FATAL_ECHO_S, lone_fatals, on_fatal
from resild.controller.policy import Action
from resild.membership import NodeRole
from tests.resild.controller.test_policy import view


def test_a_fatal_from_a_spare_drops_the_spare_and_nothing_else() -> None:
    d = on_fatal(view(), "s0", "no rank holds step 6", {})
    assert d.action == Action.DROP_SPARE and d.node == "s0" and "a spare trains nothing" in d.reason


def test_a_fatal_from_one_of_two_nodes_waits_for_the_other_and_two_end_the_job() -> None:
    v = view()
    assert on_fatal(v, "a", "no rank holds step 6", {}).action == Action.NONE
    d = on_fatal(v, "b", "no rank holds step 6", {"a": (100.0, "no rank holds step 6")})
    assert d.action == Action.FAIL_JOB and d.reason == "unrecoverable: no rank holds step 6 (said by b and a)"


def test_the_only_active_node_ends_the_job_at_once() -> None:
    v = view()
    v.nodes["b"].set_role(NodeRole.FENCED)
    d = on_fatal(v, "a", "cannot shrink", {})
    assert d.action == Action.FAIL_JOB and d.reason == "unrecoverable: cannot shrink"


def test_a_fatal_no_other_node_echoes_replaces_its_node_as_suspect_after_the_echo_window() -> None:
    v = view()
    said = {"a": (100.0, "forged")}
    assert lone_fatals(100.0 + FATAL_ECHO_S - 0.1, v, said, FATAL_ECHO_S).action == Action.NONE
    d = lone_fatals(100.0 + FATAL_ECHO_S, v, said, FATAL_ECHO_S)
    assert d.action == Action.REPLACE_NODE and d.node == "a" and d.spare == "s0"
    assert not d.evidence and "its ranks alone said the job cannot go on" in d.reason  # suspected, not drained
    v.nodes["a"].set_role(NodeRole.FENCED)  # once replaced, its word is out of the job
    assert lone_fatals(200.0, v, said, FATAL_ECHO_S).action == Action.NONE
    assert on_fatal(v, "a", "again", {}).action == Action.NONE


def test_a_job_wide_fatal_names_no_node_to_fence() -> None:
    """The job stops; no node is to blame (a FAIL_JOB naming one fenced it as failed and counted a failure)."""
    d = on_fatal(view(), "b", "mismatch", {"a": (1.0, "mismatch")})
    assert d.action == Action.FAIL_JOB and d.node is None
