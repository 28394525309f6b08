"""The controller replicas' journal and leader election in etcd: pure decisions with an
injected clock, then a real three-member etcd cluster of the job's own on loopback
(TLS, client certificates), stopped after each test."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from resild.controller import etcd_journal
from resild.controller.etcd_client import Etcd, EtcdError
from resild.controller.etcd_cluster import MAX_REQUEST_BYTES, LocalEtcd
from resild.controller.etcd_election import Election, keepalive_period_s, lead_until, lease_ttl_s, still_leader
from resild.controller.etcd_journal import EtcdJournal, Follower, read_records, record_key
from resild.controller.etcd_target import EtcdTarget
from tests.etcdlab.fixture import etcd_cluster  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(90)


# ---- pure ----------------------------------------------------------------------
def test_a_leader_counts_its_lease_from_the_send_less_a_margin() -> None:
    assert lead_until(10.0, 2.0, 0.25) == 11.75
    assert lead_until(10.0, 0.1, 0.25) == 10.0  # never beyond the send
    assert still_leader(11.7, 5, 11.75) and not still_leader(11.75, 5, 11.75)
    assert not still_leader(0.0, None, 99.0)  # no term: not the leader, whatever the lease
    assert 0.05 <= keepalive_period_s(1.0) <= 0.25
    # the lease follows the nodes' patience with a silent controller (--controller-timeout)
    assert lease_ttl_s(5.0) == 1 and lease_ttl_s(3.0) == 1 and lease_ttl_s(15.0) == 3 and lease_ttl_s(3600) == 10


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class UnreachableEtcd:
    """Grants and wins, then never answers again."""

    class target:
        timeout_s, endpoints = 0.1, ("https://x:1",)

    def __init__(self) -> None:
        self.down = False

    def grant(self, ttl_s: int) -> tuple[int, int]:
        return 7, ttl_s

    def txn(self, *a: Any) -> dict[str, Any]:
        return {"succeeded": True, "header": {"revision": "42"}}

    def keepalive(self, lease: int) -> int:
        if self.down:
            raise EtcdError("no etcd member answered")
        return 2

    def revoke(self, lease: int) -> None:
        raise EtcdError("no etcd member answered")


def test_a_leader_cut_off_from_etcd_stops_leading_before_its_lease_can_have_expired() -> None:
    clock, etcd = Clock(), UnreachableEtcd()
    el = Election(etcd, "/p", 0, 1, ttl_s=2, clock=clock)  # type: ignore[arg-type]
    el._start_keepalive = lambda: None  # type: ignore[method-assign]  # renewals driven by hand
    assert el.campaign() and el.term == 42 and el.is_leader()
    clock.t += 1.9  # no renewal for longer than the lease's count (a starved keep-alive thread) ...
    assert not el.is_leader()
    assert el.holds() and el.is_leader()  # ... but etcd still has the lease: asked once, still the leader
    etcd.down = True
    clock.t += 1.0
    assert el.renew() and el.is_leader()  # etcd's countdown still runs: still ours
    clock.t += 0.8  # 1.8 s after the last answered send: within the margin of the 2 s TTL
    assert not el.renew() and not el.is_leader() and not el.holds()
    el.resign()  # etcd unreachable: logged, not raised
    assert el.lease is None and el.term is None


# ---- a real cluster ---------------------------------------------------------------
def _election(c: LocalEtcd, index: int, ttl_s: int = 1) -> Election:
    t = c.target()
    return Election(Etcd(t), t.prefix, index, 1000 + index, ttl_s=ttl_s)


def test_one_leader_and_a_lost_lease_deposes_it_back_to_standing_by(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    a, b = _election(etcd_cluster, 0), _election(etcd_cluster, 1)
    assert a.campaign() and a.is_leader()
    assert not b.campaign() and not b.is_leader() and b.lease is None
    assert (info := b.leader()) is not None and (info.index, info.pid) == (0, 1000)
    time.sleep(1.5)  # longer than the TTL: the keep-alive holds it
    assert a.is_leader() and not b.campaign()
    assert a.lease is not None
    a.etcd.revoke(a.lease)  # as if etcd had expired it (a's host stalled)
    deadline = time.monotonic() + 3.0
    while a.is_leader() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not a.is_leader()  # the keep-alive learnt it: deposed
    assert b.campaign() and b.term is not None and a.term is None
    # The deposed leader stands by: it campaigns again and loses to the new one.
    assert not a.campaign() and not a.is_leader()
    first_term = b.term
    b.resign()
    assert a.campaign() and a.term is not None and a.term > first_term  # terms only grow
    a.resign()


def test_the_journal_keeps_order_and_a_new_leader_restores_it(
    etcd_cluster: LocalEtcd,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(etcd_journal, "PAGE", 7)  # several pages
    t = etcd_cluster.target()
    a = _election(etcd_cluster, 0)
    assert a.campaign()
    fa = Follower(a.etcd, t.prefix, tmp_path / "journal-0.jsonl")
    j = EtcdJournal(a.etcd, t.prefix, a, fa)
    recs = [{"action": "x", "i": i} for i in range(30)]
    assert all(j.write(r) for r in recs) and j.healthy and j.errors == 0
    standby = Follower(Etcd(t), t.prefix, tmp_path / "journal-1.jsonl")
    assert standby.poll() == 30 and standby.records == recs and standby.poll() == 0
    assert [json.loads(x) for x in (tmp_path / "journal-0.jsonl").read_text().splitlines()] == recs
    assert j.write({"action": "y"}) and standby.poll() == 1 and standby.records[-1] == {"action": "y"}
    assert [json.loads(x) for x in (tmp_path / "journal-1.jsonl").read_text().splitlines()] == [*recs, {"action": "y"}]
    # a leader change: the new leader has every record, in order, and goes on after them
    a.resign()
    b = _election(etcd_cluster, 1)
    assert b.campaign()
    jb = EtcdJournal(standby.etcd, t.prefix, b, standby)
    assert jb.next_seq == 31 and jb.write({"action": "z"})
    assert [r for _, r in read_records(Etcd(t), t.prefix)] == [*recs, {"action": "y"}, {"action": "z"}]
    b.resign()


def test_a_deposed_leaders_write_is_refused_by_the_transaction(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    t = etcd_cluster.target()
    a, b = _election(etcd_cluster, 0, ttl_s=5), _election(etcd_cluster, 1)
    assert a.campaign()
    j = EtcdJournal(a.etcd, t.prefix, a, Follower(a.etcd, t.prefix))
    assert j.write({"action": "before"})
    assert a.lease is not None
    Etcd(t).revoke(a.lease)  # a's lease is gone, and a does not know it yet
    assert b.campaign()
    assert a.is_leader() and a.term is not None  # a still believes it leads (its keep-alive has not run)
    assert not j.write({"action": "stale"})
    assert j.errors == 1 and not j.healthy and "deposed" in (j.last_error or "")
    assert [r["action"] for _, r in read_records(Etcd(t), t.prefix)] == ["before"]
    b.resign()
    a.resign()


def test_a_frame_over_max_request_bytes_is_refused_and_the_cluster_goes_on(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    t = etcd_cluster.target()
    etcd = Etcd(t)
    for size in (MAX_REQUEST_BYTES + 1024, 2 * MAX_REQUEST_BYTES, 3 * 1024 * 1024):
        with pytest.raises(EtcdError) as e:
            etcd.put(f"{t.prefix}/big", b"x" * size)
        assert "too large" in str(e.value) or "larger than max" in str(e.value), e.value
    assert etcd.get(f"{t.prefix}/big") is None
    # The journal refuses a record that large itself: a failed write, not an exception.
    a = _election(etcd_cluster, 0)
    assert a.campaign()
    j = EtcdJournal(a.etcd, t.prefix, a, Follower(a.etcd, t.prefix))
    assert not j.write({"action": "huge", "blob": "y" * (etcd_journal.MAX_RECORD_BYTES + 1)}) and j.errors == 1
    assert j.write({"action": "after"}) and j.healthy
    assert all(p.poll() is None for p in etcd_cluster.procs.values())  # no member hurt
    a.resign()


def test_writes_go_on_with_one_member_down(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    t = etcd_cluster.target()
    a = _election(etcd_cluster, 0, ttl_s=3)
    assert a.campaign()
    j = EtcdJournal(a.etcd, t.prefix, a, Follower(a.etcd, t.prefix))
    assert j.write({"action": "one"})
    etcd_cluster.stop_member(a.etcd._at, signal.SIGKILL)  # the member we talk to
    assert j.write({"action": "two"}) and a.renew() and a.is_leader()
    assert [r["action"] for _, r in read_records(Etcd(t), t.prefix)] == ["one", "two"]
    a.resign()


def test_the_journal_survives_restarting_every_member(etcd_cluster: LocalEtcd, tmp_path: Path) -> None:  # noqa: F811
    t = etcd_cluster.target()
    a = _election(etcd_cluster, 0)
    assert a.campaign()
    j = EtcdJournal(a.etcd, t.prefix, a, Follower(a.etcd, t.prefix))
    assert all(j.write({"action": "x", "i": i}) for i in range(5))
    for i in range(3):
        etcd_cluster.stop_member(i, signal.SIGKILL)  # no clean shutdown: what is committed is on disk
    with pytest.raises(EtcdError):
        Etcd(t).get(record_key(t.prefix, 0))
    # etcd gone: a failed write (counted, logged), not an exception; then no longer the leader
    t0 = time.monotonic()
    assert not j.write({"action": "lost"}) and j.errors == 1 and not j.healthy
    assert time.monotonic() - t0 < 3 * t.timeout_s + 1  # every request has its timeout
    deadline = time.monotonic() + 3
    while a.is_leader() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not a.is_leader()
    a.resign()  # etcd unreachable: logged, not raised
    again = LocalEtcd(tmp_path / "run", tmp_path / "run" / "keys", 3, job="test")  # as a resumed job would
    assert again.members == etcd_cluster.members and again.data == etcd_cluster.data and again.has_data()
    assert not str(again.data).startswith(str(tmp_path / "run"))  # a full run directory must not stop etcd
    etcd_cluster.procs = again.procs  # the fixture stops them
    again.start()
    assert [r["i"] for _, r in read_records(Etcd(t), t.prefix)] == list(range(5))


def test_members_started_one_per_host_find_each_other(tmp_path: Path) -> None:
    # The Slurm path without Slurm: each member (python -m resild.controller.etcd_cluster)
    # publishes its ports, waits for the others', makes its own certificate and becomes etcd.
    import os
    import subprocess
    import sys

    from resild.controller.etcd_cluster import slurm_target, wait_for_member_certs, wait_for_members, wait_ready
    from resild.controller.etcd_tls import forget_ca_key, make_certs
    from tests.etcdlab.fixture import ensure_etcd

    ensure_etcd()
    rd, keys = tmp_path / "run", tmp_path / "run" / "keys"
    (rd / "etcd").mkdir(parents=True)
    certs = make_certs(keys, members_sign=True)
    env = {**os.environ, "RESILD_CONTROLLER_HOST": "127.0.0.1", "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "resild.controller.etcd_cluster", "--run-dir", str(rd), "--keys", str(keys)]
    procs = [
        subprocess.Popen([*cmd, "--hosts", "n0,n1,n2", "--index", str(i)], env=env, start_new_session=True)
        for i in range(3)
    ]
    try:
        alive = lambda: all(p.poll() is None for p in procs)  # noqa: E731
        members = wait_for_members(rd, 3, 30.0, alive)
        assert [m.name for m in members] == ["m0", "m1", "m2"] and all(m.host == "127.0.0.1" for m in members)
        target = slurm_target(members, certs, "slurmjob")
        wait_ready(target, 30.0, alive)
        wait_for_member_certs(keys, [m.name for m in members], 30.0, alive)
        forget_ca_key(keys)  # as resil-run does: the members are certified, the CA key goes
        assert not certs.ca_key.exists()
        a = Election(Etcd(target), target.prefix, 0, 1)
        assert a.campaign()
        j = EtcdJournal(a.etcd, target.prefix, a, Follower(a.etcd, target.prefix))
        assert j.write({"action": "x"})
        assert [r for _, r in read_records(Etcd(target), target.prefix)] == [{"action": "x"}]
        a.resign()
        assert all((keys / "etcd" / f"member-m{i}.crt").exists() for i in range(3))
        # without the job's client certificate nothing is answered
        anon = Etcd(EtcdTarget(target.endpoints, target.prefix, target.ca))
        with pytest.raises(EtcdError):
            anon.get(f"{target.prefix}/leader")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait(15)
