"""The job's own etcd cluster (resild/controller/etcd_cluster.py): a member that dies on its
own is started again on its data (issue 39, finding 15); one stopped on purpose is not."""

from __future__ import annotations

import signal
import time

import pytest

from resild.controller.etcd_client import Etcd
from resild.controller.etcd_cluster import RESTART_BACKOFF_S, LocalEtcd
from tests.etcdlab.fixture import etcd_cluster  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(90)


def test_a_member_that_dies_is_started_again_and_the_cluster_serves(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    target = etcd_cluster.target(timeout_s=2.0)
    client = Etcd(target)
    client.put(f"{target.prefix}/k", b"v1")
    etcd_cluster.procs[1].send_signal(signal.SIGKILL)  # not stop_member: nobody meant it
    etcd_cluster.procs[1].wait(10)
    assert etcd_cluster.restart_dead() == ["m1"]
    assert etcd_cluster.restart_dead() == []  # alive again
    etcd_cluster.wait_ready(target, 30)
    assert all(p.poll() is None for p in etcd_cluster.procs.values())
    client.put(f"{target.prefix}/k", b"v2")
    etcd_cluster.stop_member(2, signal.SIGKILL)  # on purpose: stays stopped
    assert etcd_cluster.restart_dead() == [] and 2 not in etcd_cluster.procs


def test_a_member_that_keeps_dying_is_started_again_no_more_often_than_the_backoff(
    etcd_cluster: LocalEtcd,  # noqa: F811
) -> None:
    now = time.monotonic()
    etcd_cluster.procs[0].send_signal(signal.SIGKILL)
    etcd_cluster.procs[0].wait(10)
    assert etcd_cluster.restart_dead(now) == ["m0"]
    etcd_cluster.procs[0].send_signal(signal.SIGKILL)
    etcd_cluster.procs[0].wait(10)
    assert etcd_cluster.restart_dead(now + RESTART_BACKOFF_S / 2) == []
    assert etcd_cluster.restart_dead(now + RESTART_BACKOFF_S) == ["m0"]


def test_a_one_host_cluster_never_writes_its_ca_key(etcd_cluster: LocalEtcd) -> None:  # noqa: F811
    """Its members share the member certificate made with the set (finding 14)."""
    assert etcd_cluster.certs.member_cert.exists() and not etcd_cluster.certs.ca_key.exists()
