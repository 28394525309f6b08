"""The controller's answer to STATUS (`resild cluster`): the epoch, the committed step, the
job's width, the spare pool (hot, starting, queued, target) and each node's role, health,
ranks and heartbeat age. Read-only."""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any

from resild.controller.state import ControllerState
from resild.controller.view import ClusterView


def status(
    view: ClusterView, max_step: int, drained: Container[str], now: float, queued: int = 0, target: int = 0
) -> dict[str, Any]:
    """`queued`: cold spares asked of the queue and not joined yet; `target`: --spare-target."""
    m = view.membership
    spares = view.spares()
    return {
        "epoch": m.epoch if m else 0,
        "max_step": max_step,
        "world_size": m.world_size if m else view.full_world,
        "full_world": view.full_world,  # below it: shrunk (--min-replicas), growing back as spares come
        "pool": {
            "hot": sum(1 for n in spares if n.registered),
            "starting": sum(1 for n in spares if not n.registered),  # joined or re-admitted, qualifying
            "queued": queued,
            "target": target,
        },
        "nodes": [
            {
                "node": n.node_id,
                "role": n.role.value,
                "reason": n.reason,
                "health": n.health,
                "drained": n.node_id in drained,
                "ranks": list(m.node_ranks.get(n.node_id, ())) if m else [],
                "heartbeat_age_s": round(now - n.last_heartbeat_s, 3) if n.registered else None,
            }
            for n in view.nodes.values()
        ],
    }


def answer(s: ControllerState, spare_target: int = 0) -> dict[str, Any]:
    """The STATUS reply from the controller's shared state, now."""
    queued = s.backend.spares_on_the_way(frozenset(s.joined_sources))
    out = status(s.view, s.max_step, getattr(s.backend, "drained", {}), time.monotonic(), queued, spare_target)
    out["stragglers"] = sorted(n for e, n in s.stragglers_said if e == s.paces.epoch)  # found this epoch
    return out
