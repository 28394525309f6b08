"""Qualification before a node holds ranks (resild.health.qualify, resild.health.selftest)."""

from __future__ import annotations

from resild.health import selftest
from resild.health.model import Verdict
from resild.health.qualify import qualification


def test_the_self_test_passes_on_a_sound_device_and_catches_a_wrong_result() -> None:
    good = selftest.run()
    assert good.ok and good.reasons() == []
    (d,) = good.devices
    assert d.copy_ok and d.matmul_rel_err is not None and d.matmul_rel_err < selftest.TOLERANCE["cpu"]

    def flip(t):  # one element off, as a bad SM or memory cell would make it
        t = t.clone()
        t[3, 7] += 1.0e3
        return t

    bad = selftest.run(corrupt=flip)
    assert not bad.ok
    (why,) = bad.reasons()
    assert why.startswith("self-test on cpu: matmul off by") and "at most 0.0001" in why


def test_a_device_that_raises_fails_its_test() -> None:
    def boom(t):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    r = selftest.run(corrupt=boom)
    assert not r.ok and "illegal memory access" in r.reasons()[0]


def test_only_a_healthy_node_that_passed_its_self_test_qualifies() -> None:
    passed = selftest.SelfTest(True, [selftest.DeviceResult("cpu", True)])
    failed = selftest.SelfTest(
        False, [selftest.DeviceResult("cuda:1", False, error="host-device copy came back different")]
    )
    assert qualification(Verdict.HEALTHY, [], passed).qualified
    q = qualification(Verdict.DEGRADED, ["gpu0: row remap pending"], passed)
    assert not q.qualified and q.reasons == ("health degraded: gpu0: row remap pending",)
    q = qualification(Verdict.HEALTHY, [], failed)
    assert not q.qualified and q.reasons == ("self-test on cuda:1: host-device copy came back different",)
    unable = selftest.SelfTest(False, error="torch is not installed here")
    assert qualification(Verdict.HEALTHY, [], unable).reasons == ("self-test: torch is not installed here",)
