"""etcd as the controller replicas see it: its JSON gateway (etcd3gw) on any of the
cluster's members, TLS with the job's client certificate, every request with a timeout.

A member that does not answer (dead, partitioned, no quorum) is passed over for the next
one; the caller sees `EtcdError` only when none answered. Keys and values are bytes on
the wire (base64 in the gateway's JSON); here they are str.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests
from etcd3gw import Etcd3Client
from etcd3gw import exceptions as etcd_exc

from resild.controller.etcd_target import EtcdTarget

log = logging.getLogger("resild.etcd")

API_PATH = "/v3/"  # etcd >= 3.4's gateway (3.3 said /v3beta/): no discovery round trip


class EtcdError(Exception):
    """etcd did not do what was asked: no member answered, or it refused the request."""


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode("ascii")


def unb64(s: str) -> bytes:
    return base64.b64decode(s)


def prefix_end(prefix: str) -> str:
    """The range end that selects every key starting with `prefix` (its last byte + 1)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


@dataclass
class Etcd:
    target: EtcdTarget
    _clients: list[Etcd3Client] = field(init=False)
    _at: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._clients = []
        for e in self.target.endpoints:
            u = urlsplit(e)
            assert u.hostname is not None and u.port is not None  # EtcdTarget checked it
            # Our session, not the environment's: REQUESTS_CA_BUNDLE would override the job's CA
            # and an HTTPS_PROXY would carry the journal off the machine.
            session = requests.Session()
            session.trust_env = False
            session.verify = self.target.ca if self.target.ca else True
            if self.target.cert and self.target.key:
                session.cert = (self.target.cert, self.target.key)
            self._clients.append(
                Etcd3Client(
                    host=u.hostname,
                    port=u.port,
                    protocol=u.scheme,
                    ca_cert=self.target.ca,
                    cert_key=self.target.key,
                    cert_cert=self.target.cert,
                    timeout=self.target.timeout_s,
                    api_path=API_PATH,
                    session=session,
                )
            )

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST to the gateway; the member that answered last is asked first."""
        last: Exception | None = None
        n = len(self._clients)
        for k in range(n):
            i = (self._at + k) % n
            c = self._clients[i]
            try:
                out = c.post(c.get_url(path), json=body)
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError) as e:
                last = e
                continue
            except etcd_exc.Etcd3Exception as e:  # the member answered: a refusal, not an outage
                raise EtcdError(f"{path}: {e.detail_text or e}"[:500]) from e
            except ValueError as e:  # not JSON
                raise EtcdError(f"{path}: bad answer from {self.target.endpoints[i]}: {e}") from e
            self._at = i
            if not isinstance(out, dict):
                raise EtcdError(f"{path}: bad answer from {self.target.endpoints[i]}")
            if "error" in out and "code" in out:  # a gRPC error passed through with 200
                raise EtcdError(f"{path}: {out.get('message') or out['error']}"[:500])
            return out
        raise EtcdError(f"{path}: no etcd member answered ({type(last).__name__}: {last})"[:500])

    # ---- the few operations the replicas use ------------------------------
    def get(self, key: str) -> dict[str, Any] | None:
        """The key's kv (value decoded into "value": bytes) or None."""
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def range(self, start: str, end: str, limit: int = 0) -> list[dict[str, Any]]:
        body: dict[str, Any] = {"key": b64(start), "range_end": b64(end)}
        if limit:
            body["limit"] = limit
        return [_kv(kv) for kv in self.call("kv/range", body).get("kvs") or []]

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        self.call("kv/put", body)

    def txn(
        self, compare: list[dict[str, Any]], success: list[dict[str, Any]], failure: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted: it may raise a short one)."""
        out = self.call("lease/grant", {"TTL": ttl_s})
        if out.get("error"):
            raise EtcdError(f"lease/grant: {out['error']}")
        return int(out["ID"]), int(out["TTL"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL now renewed, or 0 if it is gone (expired or revoked)."""
        out = self.call("lease/keepalive", {"ID": lease})
        return max(0, int((out.get("result") or {}).get("TTL", 0)))

    def revoke(self, lease: int) -> None:
        self.call("kv/lease/revoke", {"ID": lease})


def _kv(kv: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": unb64(kv["key"]).decode(),
        "value": unb64(kv.get("value", "")),
        "create_revision": int(kv.get("create_revision", 0)),
        "mod_revision": int(kv.get("mod_revision", 0)),
        "lease": int(kv.get("lease", 0)),
    }
