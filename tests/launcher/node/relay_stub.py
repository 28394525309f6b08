"""A stand-in for a training worker behind its node's relay (no torch), for test_relay.

It registers with the controller directly, gets memberships through RelayClient (and
whatever the controller still sends directly), commits STUB_STEPS steps through the
relay, then reports "wait" as if blocked in a collective, except rank STUB_HANG_RANK,
which goes silent (hung). Every membership received is a line in STUB_OUT/<node>-<lr>.jsonl.
STUB_LATE=<node>/<lr> makes that worker connect to the relay only after the controller
sent it epoch 1 directly (a worker that joins its relay late).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import zmq

from launcher.worker.links.relay import RelayClient
from resild.membership import Membership
from resild.wire.channel import connect
from resild.wire.keys import KeyDir
from resild.wire.protocol import MsgType


def main() -> int:
    node, lr = os.environ["RESILD_NODE"], int(os.environ["RESILD_LOCAL_RANK"])
    out = Path(os.environ["STUB_OUT"]) / f"{node}-{lr}.jsonl"
    late = os.environ.get("STUB_LATE") == f"{node}/{lr}"
    hang_rank, steps = int(os.environ.get("STUB_HANG_RANK", "-1")), int(os.environ.get("STUB_STEPS", "5"))
    keys = KeyDir(Path(os.environ["RESILD_KEYS"])) if os.environ.get("RESILD_KEYS") else None
    ctx = zmq.Context()
    sender = f"{node}/w{lr}/{os.getpid()}"
    direct = connect(ctx, os.environ["RESILD_CONTROLLER"], keys, sender)
    relay = None if late else RelayClient(os.environ["RESILD_RELAY"], sender, ctx=ctx)
    if relay is not None:
        time.sleep(0.5)  # the node tells the controller this rank is relayed
    direct.send(MsgType.REGISTER_WORKER, {"node": node, "local_rank": lr, "pid": os.getpid()})
    m: Membership | None = None
    rank: int | None = None
    step, next_commit, waiting = 0, 0.0, False

    def on(source: str, msg) -> None:
        nonlocal m, rank
        if msg.type == MsgType.SHUTDOWN:
            raise SystemExit(0)
        if msg.type != MsgType.MEMBERSHIP:
            return
        got = Membership.from_dict(msg.body)
        with out.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "source": source,
                        "epoch": got.epoch,
                        "t": time.monotonic(),
                        "world_size": got.world_size,
                        "layout": {n: list(r) for n, r in got.node_ranks.items()},
                    }
                )
                + "\n"
            )
        if m is None or got.epoch > m.epoch:
            m, rank = got, got.rank_of(node, lr)

    while True:
        if relay is not None and (msg := relay.recv(0.02)) is not None:
            on("relay", msg)
        if relay is None:
            time.sleep(0.02)
        while (got := direct.recv(0)) is not None:
            on("direct", got[1])
        if late and relay is None and m is not None:
            relay = RelayClient(os.environ["RESILD_RELAY"], sender, ctx=ctx)  # joins late
        if m is None or rank is None or relay is None or m.epoch != 1:
            continue
        now = time.monotonic()
        if step < steps and now >= next_commit:
            step += 1
            next_commit = now + 0.05
            relay.send(
                MsgType.PROGRESS, {"node": node, "rank": rank, "epoch": m.epoch, "step": step, "state": "commit"}
            )
        elif step >= steps and not waiting and rank != hang_rank:
            waiting = True
            relay.send(MsgType.PROGRESS, {"node": node, "rank": rank, "epoch": m.epoch, "step": step, "state": "wait"})


if __name__ == "__main__":
    sys.exit(main())
