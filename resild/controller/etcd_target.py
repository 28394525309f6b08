"""Where a job's etcd is and how to speak to it: the `etcd` entry of the replicas' spec.
No etcd client here (resil-run parses --etcd without the standby extra's packages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class EtcdTarget:
    """Where the job's etcd is and how to speak to it (a spec's `etcd` entry)."""

    endpoints: tuple[str, ...]  # http(s)://host:port, client URLs of the members
    prefix: str  # every key of this job lives under it: /resild/<job>
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    timeout_s: float = 1.0  # per request and member

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoints": list(self.endpoints),
            "prefix": self.prefix,
            "ca": self.ca,
            "cert": self.cert,
            "key": self.key,
            "timeout_s": self.timeout_s,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> EtcdTarget:
        endpoints = tuple(str(e) for e in d["endpoints"])
        if not endpoints:
            raise ValueError("etcd: no endpoints")
        for e in endpoints:
            u = urlsplit(e)
            if u.scheme not in ("http", "https") or not u.hostname or not u.port:
                raise ValueError(f"etcd endpoint {e!r} is not http(s)://host:port")
        prefix = str(d["prefix"]).rstrip("/")
        if not prefix.startswith("/"):
            raise ValueError(f"etcd prefix {prefix!r} must start with /")
        return EtcdTarget(
            endpoints,
            prefix,
            d.get("ca"),
            d.get("cert"),
            d.get("key"),
            float(d.get("timeout_s", 1.0)),
        )
