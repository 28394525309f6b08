"""The controller's answer to STATUS (`resild cluster`): the epoch, the committed step
and each node's role, health, ranks and heartbeat age. Read-only."""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Any

from resild.controller.state import ControllerState
from resild.controller.view import ClusterView


def status(view: ClusterView, max_step: int, drained: Container[str], now: float) -> dict[str, Any]:
    m = view.membership
    return {
        "epoch": m.epoch if m else 0,
        "max_step": max_step,
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


def answer(s: ControllerState) -> dict[str, Any]:
    """The STATUS reply from the controller's shared state, now."""
    return status(s.view, s.max_step, getattr(s.backend, "drained", {}), time.monotonic())
