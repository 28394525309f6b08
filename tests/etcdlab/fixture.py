"""etcd for the tests: the binary installed if missing (apt-get, as the Slurm lab installs
Slurm: CI runs as root on a fresh Debian), and a job's three-member cluster on loopback
that is stopped (no orphans) when the test ends.

Without etcd and no way to install it the tests skip, unless RESILD_REQUIRE_SLURM=1 (CI,
which requires the lab's packages): then they fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from resild.controller.etcd_cluster import LocalEtcd, etcd_binary

_tried: list[str] = []  # the reason installation failed, once per session


def ensure_etcd() -> str:
    """The etcd binary's path; installs Debian's etcd-server if it is missing."""
    found = etcd_binary()
    if found:
        return found
    if not _tried:
        reason = ""
        if shutil.which("apt-get") is None or os.geteuid() != 0:
            reason = "etcd is not installed and apt-get cannot run here (not root, or not Debian)"
        else:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            try:
                subprocess.run(
                    ["apt-get", "-o", "DPkg::Lock::Timeout=120", "update", "-qq"],
                    check=True, capture_output=True, timeout=300, env=env,
                )  # fmt: skip
                subprocess.run(
                    ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "-qq",
                     "--no-install-recommends", "etcd-server"],
                    check=True, capture_output=True, timeout=600, env=env,
                )  # fmt: skip
            except (subprocess.SubprocessError, OSError) as e:
                out = getattr(e, "stderr", b"") or b""
                reason = f"apt-get install etcd-server failed: {e} {out.decode(errors='replace')[-300:]}"
        _tried.append(reason or "")
    found = etcd_binary()
    if found:
        return found
    reason = _tried[0] or "etcd-server installed but no etcd binary found"
    if os.environ.get("RESILD_REQUIRE_SLURM") == "1":
        pytest.fail(f"etcd required (RESILD_REQUIRE_SLURM=1) but unavailable: {reason}")
    pytest.skip(reason)


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalEtcd]:
    ensure_etcd()
    cluster = LocalEtcd(tmp_path / "run", tmp_path / "run" / "keys", 3, job="test")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.remove_data()  # stops the members first
