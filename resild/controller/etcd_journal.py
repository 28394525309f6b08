"""The controller's journal in etcd: one key per record, `<prefix>/journal/<seq>` (the
sequence zero-padded, so key order is record order), written by the leader only.

Every append is a transaction guarded by the leader's lease: it commits only while the
leader key is still the one this leader created (its create revision is the leader's
term) and the record's key is new. A deposed leader's write is refused by etcd itself,
whatever the deposed leader believes. A refused, failed or timed-out write is a failed
journal write (logged, counted, `journal_error`; never an exception), as with a disk.

Each replica also keeps a copy of the records in its own JSON-lines file (for `resild
report`, and to see a job's decisions without etcd): `Follower` reads the journal while
the replica stands by and adds the leader's own records as they commit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from resild.controller.etcd_client import Etcd, EtcdError, b64, prefix_end
from resild.controller.etcd_election import Election
from resild.controller.journal import Journal

log = logging.getLogger("resild.etcd.journal")

SEQ_DIGITS = 12
MAX_RECORD_BYTES = 1024 * 1024  # below etcd's --max-request-bytes (1.5 MiB) with the base64 and txn around it
PAGE = 500  # records per range request when reading the journal


def journal_prefix(prefix: str) -> str:
    return f"{prefix}/journal/"


def record_key(prefix: str, seq: int) -> str:
    return f"{journal_prefix(prefix)}{seq:0{SEQ_DIGITS}d}"


def seq_of(key: str) -> int:
    return int(key.rsplit("/", 1)[1])


def read_records(etcd: Etcd, prefix: str, after_seq: int = -1) -> list[tuple[int, dict[str, Any]]]:
    """Every record after `after_seq`, in order, with its sequence number. A record that is
    not a JSON object is skipped (logged), like a torn line in a journal file."""
    start = record_key(prefix, after_seq + 1)
    end = prefix_end(journal_prefix(prefix))
    out: list[tuple[int, dict[str, Any]]] = []
    while True:
        kvs = etcd.range(start, end, limit=PAGE)
        for kv in kvs:
            try:
                rec = json.loads(kv["value"])
                if not isinstance(rec, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                log.error("journal key %s is not a record (%s): skipped", kv["key"], e)
                continue
            out.append((seq_of(kv["key"]), rec))
        if len(kvs) < PAGE:
            return out
        start = kvs[-1]["key"] + "\0"


class EtcdJournal(Journal):
    """The controller's Journal while this replica leads: `append` is true once etcd
    (a majority of its members, on disk) holds the record. Replicated: a record etcd did
    not commit is a decision this replica may no longer make (the controller carries out
    nothing of it; journal.py)."""

    replicated = True

    def __init__(self, etcd: Etcd, prefix: str, election: Election, follower: Follower) -> None:
        super().__init__(None)
        self.etcd, self.prefix, self.election, self.follower = etcd, prefix, election, follower
        self.next_seq = follower.last_seq + 1  # the follower has read the whole journal before

    def write(self, record: dict[str, Any]) -> bool:
        term = self.election.term
        if term is None or not self.election.holds():  # (etcd would refuse it anyway)
            self._failed(RuntimeError("etcd: not the leader"), record)
            return False
        try:
            data = json.dumps(record, separators=(",", ":"), allow_nan=False).encode()
        except (ValueError, TypeError) as e:
            self._failed(e, record)
            return False
        if len(data) > MAX_RECORD_BYTES:
            self._failed(ValueError(f"etcd: record of {len(data)} bytes over {MAX_RECORD_BYTES}"), record)
            return False
        # A sequence number is used once, whatever became of the write: a write that timed
        # out may still commit, and the next record must not collide with it.
        seq = self.next_seq
        self.next_seq += 1
        key = record_key(self.prefix, seq)
        try:
            out = self.etcd.txn(
                [
                    {
                        "key": b64(self.election.key),
                        "target": "CREATE",
                        "result": "EQUAL",
                        "create_revision": term,
                    },
                    {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": 0},
                ],
                [{"request_put": {"key": b64(key), "value": b64(data)}}],
                [],
            )
        except EtcdError as e:
            self._failed(e, record)
            return False
        if not out.get("succeeded"):
            self._failed(RuntimeError("etcd: refused, the leader key is no longer ours (deposed)"), record)
            return False
        if not self.healthy:
            log.warning("etcd journal writable again after %d failed write(s)", self.errors)
            self.healthy = True
        self.follower.add(seq, record)
        return True

    def status(self) -> dict[str, Any]:
        return {**super().status(), "replicated": True, "etcd": list(self.etcd.target.endpoints)}

    def close(self) -> None:
        pass  # the follower (and its file) outlives a leadership: a deposed leader stands by


class Follower:
    """A standby's view of the journal: the records so far, kept up to date by `poll`
    (and copied to the replica's own file)."""

    def __init__(self, etcd: Etcd, prefix: str, copy: Path | None = None) -> None:
        self.etcd, self.prefix = etcd, prefix
        self.records: list[dict[str, Any]] = []
        self.last_seq = -1
        self.copy = Journal(copy) if copy is not None else None

    def poll(self) -> int:
        """Read what is new; the number of new records (EtcdError when etcd cannot be read)."""
        new = read_records(self.etcd, self.prefix, self.last_seq)
        for seq, rec in new:
            self.add(seq, rec)
        return len(new)

    def add(self, seq: int, rec: dict[str, Any]) -> None:
        """A record this replica knows is committed (read, or written by it as the leader)."""
        if seq <= self.last_seq:
            return
        self.records.append(rec)
        self.last_seq = seq
        if self.copy is not None:
            self.copy.write(rec)

    def close(self) -> None:
        if self.copy is not None:
            self.copy.close()
