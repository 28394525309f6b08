"""Where a service advertised under a host name listens (the controller's socket under
Slurm, the Raft port). The job's rendezvous keys are held by the leading controller
(resild.rendezvous) and reached over the authenticated link; the committed
floor travels in the membership."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

# ---- where a service listens ---------------------------------------------------------------


def listen_address(host: str, *, cluster: bool, what: str) -> tuple[int, str]:
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
