"""What one node's key can say, and what it can no longer do (issue 39, findings 2 and 3),
against a real controller over real sockets (fake node processes, as
tests/resild/controller/test_controller_relay.py): a claim of step 2^53 - 1 does not become
the job's committed step, and one FATAL ends no job: from a spare it drops the spare, from
one node alone it replaces that node once no other echoes it; from two nodes it ends the job."""

from __future__ import annotations

import time

import zmq

from resild.controller.fatal import FATAL_ECHO_S
from resild.controller.loop import Controller
from resild.events.log import EventLog
from resild.wire.channel import Channel, connect
from resild.wire.protocol import MsgType
from tests.resild.controller.test_controller_relay import cluster, wait_event  # noqa: F401 (a fixture)

HUGE = 2**53 - 1


def _start(ctl: Controller, events: EventLog, ctx: zmq.Context) -> dict[str, Channel]:
    nodes = {n: connect(ctx, ctl.endpoint, None, f"{n}/node") for n in ("a", "b", "s0", "s1")}
    for n, ch in nodes.items():
        ch.send(MsgType.REGISTER_NODE, {"node": n, "pid": 1, "nproc": 2, "epoch": 0, "relayed": [0, 1]})
        for lr in (0, 1):
            ch.send(MsgType.REGISTER_WORKER, {"node": n, "local_rank": lr, "pid": 1})
    wait_event(events, "membership")
    return nodes


def _commits(ch: Channel, node: str, ranks: tuple[int, int], step: int) -> None:
    ch.send(MsgType.PROGRESS, {"node": node, "epoch": 1, "state": "commit", "commits": {str(r): step for r in ranks}})


def _until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


def test_a_claim_of_step_2_53_does_not_become_the_jobs_committed_step(cluster) -> None:  # noqa: F811
    ctl, events, ctx = cluster
    nodes = _start(ctl, events, ctx)
    _commits(nodes["a"], "a", (0, 1), 7)
    _commits(nodes["b"], "b", (2, 3), 7)
    assert _until(lambda: ctl.max_step == 7)
    _commits(nodes["b"], "b", (2, 3), HUGE)  # b's key lies
    _commits(nodes["a"], "a", (0, 1), 9)
    assert _until(lambda: ctl.max_step == 9)  # a's honest step, vouched for by b's claim
    time.sleep(0.2)
    assert ctl.max_step == 9  # never b's number: what two nodes say
    # the next ordinary recovery keeps the honest floor (it stopped the job before the fix)
    nodes["a"].send(MsgType.WORKER_EXIT, {"node": "a", "local_rank": 0, "pid": 1, "returncode": -9})
    m = wait_event(events, "spare_assigned")
    assert m["failed"] == "a"
    assert _until(lambda: ctl.view.membership is not None and ctl.view.membership.epoch == 2)
    assert ctl.view.membership is not None and ctl.view.membership.committed == 9 and ctl.result is None


def test_one_fatal_ends_no_job_two_nodes_do(cluster) -> None:  # noqa: F811
    ctl, events, ctx = cluster
    nodes = _start(ctl, events, ctx)
    nodes["s0"].send(MsgType.FATAL, {"node": "s0", "error": "forged by s0's key"})
    dropped = wait_event(events, "failure_detected")
    assert dropped["node"] == "s0" and "a spare trains nothing" in dropped["cause"], dropped
    t0 = time.monotonic()
    nodes["b"].send(MsgType.FATAL, {"node": "b", "error": "forged by b's key"})
    replaced = wait_event(events, "spare_assigned", FATAL_ECHO_S + 5)
    assert replaced["failed"] == "b" and time.monotonic() - t0 >= FATAL_ECHO_S - 0.5, replaced
    assert ctl.result is None  # the job goes on, with s1 in b's place
    fenced = [e for e in events.records if e["event"] == "node_fenced" and e["node"] == "b"]
    assert fenced and not fenced[0]["drained"] and "its ranks alone said" in fenced[0]["reason"], fenced
    nodes["a"].send(MsgType.FATAL, {"node": "a", "error": "no rank holds step 6"})  # a second node: job-wide
    assert _until(lambda: ctl.result is not None)
    assert ctl.result is not None and ctl.result.exit_code == 1
    assert ctl.result.reason == "unrecoverable: no rank holds step 6 (said by a and b)"
