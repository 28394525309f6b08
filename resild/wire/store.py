"""The job's rendezvous store (torch's TCPStore, hosted by the controller, or by each
standby replica: the store moves with the leader): its socket. The controller keeps
nothing there (the committed floor travels in the membership)."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

# ---- the rendezvous store's listening socket --------------------------------------------


def listen_address(host: str, *, cluster: bool, what: str = "the rendezvous store") -> tuple[int, str]:
    """(family, ip) to listen on for a service advertised as `host`: exactly its address,
    never every interface, so it is reachable only where peers are (loopback for a local
    job, the advertised job address under Slurm)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeError(f"cannot resolve the advertised host {host!r}: {e.strerror}") from None
    ip = str(addr[0])  # AF_INET/AF_INET6: the host's address as text
    if cluster and (ip.startswith("127.") or ip == "::1"):
        # Other nodes could never connect to a loopback listener: a Debian-style
        # /etc/hosts maps the FQDN to 127.0.1.1. Listen everywhere, and say so.
        log.warning(
            "advertised host %s resolves to %s on this host: %s listens on every interface; "
            "set RESILD_CONTROLLER_HOST to this host's job-network address",
            host,
            ip,
            what,
        )
        return socket.AF_INET, "0.0.0.0"
    return family, ip


def store_listen_fd(host: str, *, cluster: bool) -> tuple[int, int]:
    """A TCP listening socket on exactly `host`'s address (`listen_address`), for torch's
    TCPStore (`master_listen_fd=`), which would otherwise listen on every interface: the
    store has no authentication. Returns (fd, port); the fd is handed over (the caller's
    store owns it)."""
    family, ip = listen_address(host, cluster=cluster)
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ip, 0))
        s.listen(4096)
        port = s.getsockname()[1]
    except OSError:
        s.close()
        raise
    return s.detach(), port
