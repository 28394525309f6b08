"""CURVE keys per job or site, and the ZAP authenticator that names a peer by its key.

DEALERs. Keys are generated per job (local mode) or provisioned by the site
(cluster mode) by `generate_keys`:

    DIR/server.key, server.key_secret     the controller's pair (stays on the controller host)
    DIR/client.key, client.key_secret     the operator's pair (User-Id "client": `resild cluster`)
    DIR/authorized/<name>.key             every public key the controller accepts; the file
                                          name is the identity (ZAP User-Id) of its holder
    DIR/nodes/<node>/                     what node <node> gets, and nothing else: its own
                                          pair plus the server's *public* key
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

ADMIN = "client"  # identity of DIR/client.key, the operator's (`resild cluster`): may ask
# for status, speaks for no node (name kept from the one-key layout)
JOINER = "join"  # identity of DIR/join/: the job secret that `resil-run --join` holds; may ask to
# join the job as a spare (the controller mints the newcomer's own node key), nothing else
RESERVED = (ADMIN, JOINER)
NODE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class KeyDir:
    path: Path

    @property
    def authorized(self) -> Path:
        return self.path / "authorized"

    def server(self) -> tuple[bytes, bytes]:
        return _load(self.path / "server.key_secret")

    def client(self) -> tuple[bytes, bytes]:
        return _load(self.path / "client.key_secret")

    def server_public(self) -> bytes:
        pub, _ = zmq.auth.load_certificate(str(self.path / "server.key"))
        return pub

    def node(self, name: str) -> KeyDir:
        """The directory to hand to node `name` (its pair + the server's public key only)."""
        return KeyDir(self.path / "nodes" / name)


def _load(secret_file: Path) -> tuple[bytes, bytes]:
    if not secret_file.exists():
        raise FileNotFoundError(f"CURVE key {secret_file} is missing (run `resild keys` or let resil-run make them)")
    pub, sec = zmq.auth.load_certificate(str(secret_file))
    assert sec is not None
    return pub, sec


def _pair(directory: Path, name: str) -> None:
    zmq.auth.create_certificates(str(directory), name)
    os.chmod(directory / f"{name}.key_secret", 0o600)


def generate_keys(path: Path, nodes: Iterable[str] = ()) -> KeyDir:
    """Create the server pair, the operator pair and one pair per node under `path`
    (directories 0700, secrets 0600); see the module docstring for the layout."""
    if path.exists():
        shutil.rmtree(path)  # a reused run directory: this job's keys only, nothing stale stays authorized
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    _pair(path, "server")
    _pair(path, "client")
    (path / "authorized").mkdir(exist_ok=True)
    shutil.copy(path / "client.key", path / "authorized" / f"{ADMIN}.key")
    for node in nodes:
        add_node_key(KeyDir(path), node)
    return KeyDir(path)


def add_node_key(keys: KeyDir, node: str) -> KeyDir:
    if not NODE_NAME.fullmatch(node) or node in RESERVED:
        raise ValueError(f"node name {node!r} cannot name a key (letters, digits, _ . - only)")
    return _holder(keys, keys.node(node).path, node)


def add_join_key(keys: KeyDir) -> KeyDir:
    """The job secret for `resil-run --join`: DIR/join/ (its pair and the server's public
    key), readable by the job's user only, authorized as JOINER."""
    return _holder(keys, keys.path / JOINER, JOINER)


def _holder(keys: KeyDir, d: Path, name: str) -> KeyDir:
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    _pair(d, "client")
    shutil.copy(keys.path / "server.key", d / "server.key")
    shutil.copy(d / "client.key", keys.authorized / f"{name}.key")
    return KeyDir(d)


class _KeyAuthenticator(ThreadAuthenticator):
    """ZAP handler: accepts exactly the keys in authorized/ and reports the file's
    name as the connection's User-Id (readable on every received frame)."""

    RESCAN_S = 0.5  # an unknown key re-reads authorized/ at most this often

    def __init__(self, ctx: zmq.SyncContext, authorized: Path) -> None:
        super().__init__(ctx, log=logging.getLogger("resild.auth"))
        self.authorized = authorized
        self.user_ids: dict[bytes, str] = {}
        self._scanned_s = -1e9
        self._scan()

    def _scan(self) -> None:
        """Node keys may be added after the server started (a backend makes them just
        before it starts the nodes): re-read the directory. Runs on the auth thread."""
        self._scanned_s = time.monotonic()
        self._mtime_ns = self._dir_mtime()
        ids: dict[bytes, str] = {}
        for f in sorted(self.authorized.glob("*.key")):
            try:
                pub, _ = zmq.auth.load_certificate(str(f))
            except (OSError, ValueError) as e:
                log.error("ignoring unreadable key %s: %s", f, e)
                continue
            ids[pub] = f.stem  # load_certificate returns the z85 text
        self.user_ids = ids

    def _dir_mtime(self) -> int:
        try:
            return self.authorized.stat().st_mtime_ns
        except OSError:
            return -1

    def callback(self, domain: str, z85_key: bytes) -> bool:  # credentials provider
        if z85_key not in self.user_ids and (
            self._dir_mtime() != self._mtime_ns or time.monotonic() - self._scanned_s >= self.RESCAN_S
        ):
            self._scan()
        ok = z85_key in self.user_ids
        if not ok:
            self.log.warning("DENIED unknown CURVE key %s", z85_key.decode(errors="replace"))
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.user_ids[z85.encode(client_public_key)]


def data_key(keys: KeyDir, job: str) -> bytes:
    """The job's key for authenticating training state on the wire (launcher.worker.
    transport.mac), from the controller's CURVE secret key: every controller of the job
    (standbys too) holds that one, and derives the same key without storing another."""
    _, secret = keys.server()
    return hmac.new(secret, b"resild-data-key-v1|" + job.encode(), hashlib.sha256).digest()
