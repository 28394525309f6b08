"""The fault specs of the disk checkpoint's fault-injecting storage (tests and drills)."""

from __future__ import annotations

import pytest

from launcher.worker.redundancy.checkpoint_faults import (
    CheckpointFault,
    CheckpointFaultError,
    Faults,
    parse,
)


def test_checkpoint_fault_specs_parse_and_bad_ones_say_the_grammar() -> None:
    assert parse("write:fail@20:r1, plan:hang@40,complete:slow2.5@60,finish:outlive@7,write:die@9:r1:node1") == [
        CheckpointFault("write", "fail", 20, 1),
        CheckpointFault("plan", "hang", 40),
        CheckpointFault("complete", "slow", 60, None, 2.5),
        CheckpointFault("finish", "outlive", 7),
        CheckpointFault("write", "die", 9, 1, 0.0, "node1"),
    ]
    assert parse("") == []
    for bad in ("write:explode@3", "disk:fail@3", "write:fail", "write:fail@3:-node1"):
        with pytest.raises(CheckpointFaultError, match="POINT:MODE@STEP"):
            parse(bad)


def test_a_fault_hits_its_rank_and_node_once_at_the_first_save_at_or_after_its_step() -> None:
    f = Faults(parse("write:fail@20:r1"), rank=1)
    f.hit("write", 19, lambda: False)
    f.hit("plan", 20, lambda: False)
    with pytest.raises(OSError, match="injected checkpoint fault write:fail@20 \\(saving step 23\\)"):
        f.hit("write", 23, lambda: False)  # a save deferred past its due step still meets it
    f.hit("write", 30, lambda: False)  # once
    Faults(parse("write:fail@20:r1"), rank=0).hit("write", 20, lambda: False)
    on_node = parse("write:fail@20:node1")
    with pytest.raises(OSError):
        Faults(on_node, rank=3, node="local-node1").hit("write", 20, lambda: False)
    Faults(on_node, rank=3, node="local-node2").hit("write", 20, lambda: False)  # a spare taking node1's ranks
