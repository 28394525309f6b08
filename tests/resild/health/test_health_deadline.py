from __future__ import annotations

import threading
import time

import pytest

from resild.health.deadline import CallTimeout, DeadlineRunner

pytestmark = pytest.mark.timeout(30)


def test_results_errors_and_timeouts() -> None:
    runner = DeadlineRunner()
    release = threading.Event()
    try:
        assert runner.call(lambda a, b: a + b, 2, 3, timeout_s=1.0) == 5
        with pytest.raises(KeyError):
            runner.call({}.__getitem__, "x", timeout_s=1.0)

        t0 = time.monotonic()
        with pytest.raises(CallTimeout, match="stuck did not return within 0.1 s"):
            runner.call(release.wait, 10, timeout_s=0.1, key="gpu1", name="stuck")
        assert time.monotonic() - t0 < 1.0
        # The same key fails at once while its call is stuck; other keys work.
        t0 = time.monotonic()
        with pytest.raises(CallTimeout, match=r"earlier call \(stuck\) has not returned"):
            runner.call(lambda: 1, timeout_s=1.0, key="gpu1")
        assert time.monotonic() - t0 < 0.5  # at once: well under the call's own 1 s timeout
        assert runner.call(lambda: 7, timeout_s=1.0, key="gpu0") == 7
        release.set()  # the stuck call returns: the key works again
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                assert runner.call(lambda: 8, timeout_s=1.0, key="gpu1") == 8
                break
            except CallTimeout:
                time.sleep(0.01)
        else:
            pytest.fail("key still reported stuck after its call returned")
    finally:
        release.set()
        runner.close()
