"""What the controller keeps in the job's rendezvous store (torch's TCPStore, hosted
by the controller, or by each standby replica: the store moves with the leader)."""

from __future__ import annotations

import logging
import socket
from typing import Any

from resild.events.schema import EventName

log = logging.getLogger(__name__)

COMMITTED_KEY = "resild/committed"  # newest step the controller saw committed at a failure


class CommittedFloor:
    """An event listener: publishes, in the rendezvous store, the newest step the
    controller knew to be committed when it decided a failure. A recovery that finds
    no rank at that step has lost every replica of the state: it must stop, not
    restart from step 0."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("event") == EventName.FAILURE_DETECTED:
            self.publish(int(rec.get("committed_step") or 0))

    def publish(self, step: int) -> None:
        self.store.set(COMMITTED_KEY, str(step))


# ---- the rendezvous store's listening socket --------------------------------------------


def store_listen_fd(host: str, *, cluster: bool) -> tuple[int, int]:
    """A TCP listening socket on exactly `host`'s address, for torch's TCPStore
    (`master_listen_fd=`), which would otherwise listen on every interface. The
    store has no authentication, so it must be reachable only where peers are:
    loopback for a local job, the advertised job address under Slurm. Returns
    (fd, port); the fd is handed over (the caller's store owns it)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeError(f"cannot resolve the advertised host {host!r}: {e.strerror}") from None
    ip = str(addr[0])  # AF_INET/AF_INET6: the host's address as text
    if cluster and (ip.startswith("127.") or ip == "::1"):
        # Other nodes could never connect to a loopback listener: a Debian-style
        # /etc/hosts maps the FQDN to 127.0.1.1. Listen everywhere, and say so.
        log.warning(
            "advertised host %s resolves to %s on this host: the rendezvous store listens on "
            "every interface; set RESILD_CONTROLLER_HOST to this host's job-network address",
            host,
            ip,
        )
        family, addr = socket.AF_INET, ("0.0.0.0", 0)
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(4096)
        port = s.getsockname()[1]
    except OSError:
        s.close()
        raise
    return s.detach(), port
