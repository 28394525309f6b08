"""Every connection of a newly formed gloo group proves it belongs to the job before the group is used.

gloo gives a connection to a peer rank by a small sequence number that the connecting side
sends. Anyone who reaches a rank's pair listener first (a local user, the network) is taken
for that peer: it receives what the rank sends that peer (gradients, replayed state) and its
bytes are summed into the rank's collectives (issue 39, finding 1). The state a rank loads is
tagged already (transport/mac.py); gradients are not.

So once a group's full mesh is up, and before anything runs on it, every rank sends each peer
a Poly1305 tag under the job's data key. The tag's one-time key names (epoch, group, sender,
receiver), and each rank checks the tag each peer sent it. A connection held by anyone without
the key fails the check. The formation then fails in one line naming the peer, and the
recovery forms the epoch again (a stranger can still deny service, never join a collective).
Every pair is checked, not only the ring's: gloo's algorithms and the replay use any pair.

Cost per rank and formation: 2(n-1) messages of 16 bytes, posted at once
(docs/benchmarks.md, "Pairs proven at formation"). Host (gloo) groups only: NCCL bootstraps
and connects through its own sockets (not covered; docs/security.md).
"""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Any

import torch

from launcher.worker.transport.mac import GROUP_PAIR, TAG_WORDS, Mac

AUTH_TAG = 0x3FFF0001  # the round's gloo tag: nothing else runs on a group before it is installed


class PairRefused(RuntimeError):
    """A peer's connection did not prove the job's key: str() names the group and the peers."""


def group_id(store_key: str) -> int:
    """The group's name as a tag name (int63): the same on every rank of the group."""
    return int.from_bytes(hashlib.sha256(store_key.encode()).digest()[:8], "big") >> 1


def expected(mac: Mac, epoch: int, group: int, src: int, dst: int) -> list[int]:
    return list(mac.tag([], GROUP_PAIR, epoch, group, src, dst))


def prove_pairs(pg: Any, mac: Mac, epoch: int, store_key: str, rank: int, size: int, timeout_s: float) -> None:
    """Send each peer of `pg` (this rank is `rank` of `size`) this rank's tag and check each
    peer's. Raises PairRefused naming every peer whose tag is wrong; a peer that sends
    nothing raises PairRefused once `timeout_s` has passed for the whole round (gloo's timed-out
    wait closes the group's connections: the group is discarded either way)."""
    if size < 2:
        return
    gid = group_id(store_key)
    peers = [p for p in range(size) if p != rank]
    mine = {p: torch.tensor(expected(mac, epoch, gid, rank, p), dtype=torch.int64) for p in peers}
    got = {p: torch.zeros(TAG_WORDS, dtype=torch.int64) for p in peers}
    sends = {p: pg.send([mine[p]], p, AUTH_TAG) for p in peers}
    recvs = {p: pg.recv([got[p]], p, AUTH_TAG) for p in peers}
    deadline = time.monotonic() + timeout_s  # one for the round: k silent peers cost one timeout, not k
    where = f"group {store_key!r} of epoch {epoch}"
    for p, w in [*recvs.items(), *sends.items()]:
        try:
            w.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
        except Exception as e:  # gloo's timed-out (or broken) wait; the group is discarded either way
            raise PairRefused(
                f"{where}: the connection of rank {p} gave no proof within {timeout_s:g}s ({e})"
            ) from None
    bad = [p for p in peers if got[p].tolist() != expected(mac, epoch, gid, p, rank)]
    if bad:
        raise PairRefused(
            f"{where}: the connection of rank(s) {bad} did not prove the job's data key "
            "(something other than the job's rank holds it)"
        )


__all__ = ["AUTH_TAG", "PairRefused", "group_id", "prove_pairs"]
