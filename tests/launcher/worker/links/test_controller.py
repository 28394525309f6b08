"""The control link's thread sleeps as long as no wait report can fall due (pure rule)."""

from __future__ import annotations

import pytest

from launcher.worker.links.controller import report_poll_s


def test_nothing_in_flight_sleeps_a_whole_report_interval() -> None:
    # A collective starting now cannot be blocked for 0.5 s before 0.5 s from now.
    assert report_poll_s(0.0, False, 0.5) == pytest.approx(0.505)
    assert report_poll_s(0.0, False, 5.0) == 1.0  # capped at 1 s, a safety net


def test_a_collective_in_flight_wakes_the_thread_when_its_report_is_due() -> None:
    assert report_poll_s(0.7, False, 1.0) == pytest.approx(0.305)
    assert report_poll_s(2.0, False, 1.0) == 0.01  # overdue: at once (never a busy loop)


def test_a_reported_wait_is_looked_at_often_to_say_when_it_clears() -> None:
    assert report_poll_s(3.0, True, 1.0) == 0.1


# ---- commit reports, over a real socket ------------------------------------------------------
@pytest.mark.timeout(30)
def test_commit_reports_are_coalesced_and_keep_their_order_with_other_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A commit per step does not wake the link's thread per step: while commits flow the
    newest goes out every COMMIT_REPORT_S, so 300 fast commits are a few reports, the last
    one the newest; a message given after a commit still arrives after it; a lone commit
    after a quiet spell goes out at once."""
    import time

    import zmq

    from launcher.worker.links.controller import COMMIT_REPORT_S, ControlLink
    from launcher.worker.stable_group import Interrupts
    from resild.wire.channel import Server
    from resild.wire.protocol import Message, MsgType

    monkeypatch.delenv("RESILD_RELAY", raising=False)
    ctx = zmq.Context()
    srv = Server(ctx, "tcp://127.0.0.1:0", None)
    link = ControlLink(srv.endpoint, None, "n0", 0, Interrupts(), lambda: (0, 1, 0)).start()

    def received(wait_s: float) -> list[Message]:
        out, deadline = [], time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            got = srv.channel.recv(left)
            if got is not None:
                out.append(got[1])
        return out

    try:
        link.send(MsgType.PROGRESS, rank=0, epoch=1, step=0, state="join")
        assert [m.body["state"] for m in received(0.5)] == ["join"]
        t0 = time.monotonic()
        for step in range(1, 301):  # ~3 ms steps for ~1 s
            link.send(MsgType.PROGRESS, rank=0, epoch=1, step=step, state="commit")
            time.sleep(0.003)
        link.send(MsgType.PROGRESS, rank=0, epoch=1, step=300, state="wait")
        elapsed = time.monotonic() - t0
        got = [(m.body["state"], m.body["step"]) for m in received(0.5)]
        commits = [s for st, s in got if st == "commit"]
        assert got[-2:] == [("commit", 300), ("wait", 300)]  # the newest commit, then what came after it
        assert commits == sorted(commits) and len(set(commits)) == len(commits)
        # about one report per COMMIT_REPORT_S (more on a loaded machine: a trainer held up
        # past it finds the thread no longer looking and wakes it), never one per commit
        assert 2 <= len(commits) <= 2 * elapsed / COMMIT_REPORT_S + 5, (len(commits), elapsed)
        time.sleep(3 * COMMIT_REPORT_S)  # quiet: the thread stops looking
        t1 = time.monotonic()
        link.send(MsgType.PROGRESS, rank=0, epoch=1, step=301, state="commit")
        first = srv.channel.recv(2.0)
        assert first is not None and first[1].body["step"] == 301
        # woken for it, not found at the end of a long sleep (report_poll_s: up to 1 s)
        assert time.monotonic() - t1 < 5 * COMMIT_REPORT_S
    finally:
        link.close(0.5)
        srv.close()
        ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_a_cleared_wait_is_said_only_if_the_trainer_said_nothing_since(monkeypatch: pytest.MonkeyPatch) -> None:
    """The link reports a blocked rank "wait" and, once unblocked, "compute"; but a report of
    the trainer's own in between (a commit, or "checkpoint" while it waits for its last disk
    checkpoint) already replaced the wait: a late "compute" would take away the checkpoint's
    excuse from the hang detector, which then fenced a rank at the very end of its job."""
    import queue
    import time

    from launcher.worker.links.controller import ControlLink
    from launcher.worker.stable_group import Interrupts
    from resild.wire.protocol import MsgType

    monkeypatch.delenv("RESILD_RELAY", raising=False)
    intr = Interrupts()
    link = ControlLink("tcp://127.0.0.1:9", None, "n0", 0, intr, lambda: (0, 1, 7))  # never started
    link.wait_report_s = 0.01

    def states() -> list[str]:
        out = []
        while True:
            try:
                mtype, body, _ = link._out.get_nowait()
            except queue.Empty:
                return out
            if mtype == MsgType.PROGRESS:
                out.append(body["state"])

    for trainer_speaks in (False, True):
        token = intr.begin_wait()
        time.sleep(0.05)
        assert link._report_wait(False) is True and states() == ["wait"]
        intr.done(token)
        if trainer_speaks:
            link.send(MsgType.PROGRESS, rank=0, epoch=1, step=7, state="checkpoint")
        assert link._report_wait(True) is False
        assert states() == (["checkpoint"] if trainer_speaks else ["compute"])


@pytest.mark.timeout(60)
def test_a_dropped_link_registers_again_under_a_fresh_routing_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller does not hand a routing id in use over (issue 39, finding 13), so a
    link whose connection drops comes back under a fresh one; the controller knows a
    worker's id from its registration only, so the link registers again, and what the
    controller sends to the new id reaches the worker (the old id may be a ghost)."""
    import os
    import time

    import zmq

    from launcher.worker.links.controller import ControlLink
    from launcher.worker.stable_group import Interrupts
    from resild.wire.channel import Server
    from resild.wire.protocol import MsgType
    from tests.tcp_proxy import CuttableProxy

    monkeypatch.delenv("RESILD_RELAY", raising=False)
    ctx = zmq.Context()
    srv = Server(ctx, "tcp://127.0.0.1:0", None)
    proxy = CuttableProxy(int(srv.endpoint.rsplit(":", 1)[1]))
    link = ControlLink(f"tcp://127.0.0.1:{proxy.port}", None, "n0", 0, Interrupts(), lambda: (0, 1, 0)).start()

    def registration(not_from: bytes | None, wait_s: float) -> bytes | None:
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            got = srv.channel.recv(left)
            if got is not None and got[1].type is MsgType.REGISTER_WORKER and got[0] != not_from:
                return got[0]
        return None

    try:
        link.send(MsgType.REGISTER_WORKER, local_rank=0, pid=os.getpid())
        first = registration(None, 10.0)
        assert first is not None
        proxy.cut_clients()
        again = registration(first, 10.0)
        assert again is not None, "the link never registered again after its connection dropped"
        srv.channel.send(MsgType.WELCOME, {"role": "active"}, to=again)
        deadline = time.monotonic() + 5.0
        while link.welcome is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert link.welcome is not None and link.welcome.get("role") == "active"
    finally:
        link.close(0.5)
        proxy.close()
        srv.close()
        ctx.destroy(linger=0)
