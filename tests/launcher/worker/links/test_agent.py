"""The training runtime's link to the node daemon, against a real `resild daemon`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.worker.links.agent import AgentLink, agent_endpoint
from resild.health.fakenvml import build_fake_nvml, fake_nvml_env
from resild.wire.local_socket import local_request
from resild.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(60)


def test_endpoint_from_env(tmp_path: Path) -> None:
    assert agent_endpoint({"RESILD_AGENT_SOCKET": "/x/s.sock"}) == "ipc:///x/s.sock"
    assert agent_endpoint({"RESILD_AGENT_SOCKET": "tcp://127.0.0.1:5"}) == "tcp://127.0.0.1:5"


def test_missing_daemon_never_blocks_training(tmp_path: Path) -> None:
    link = AgentLink(f"ipc://{tmp_path}/nobody.sock", "n/rank0", lambda: 0, interval_s=0.05, timeout_s=0.1).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    link.stop()
    assert time.monotonic() - t0 < 1.5


def test_registered_rank_is_watched_and_a_stall_is_reported_hung(tmp_path: Path) -> None:
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 1\n")
    (tmp_path / "kmsg").write_text("")
    sock = tmp_path / "status.sock"
    conf = tmp_path / "resild.toml"
    conf.write_text(
        f'node = "n1"\nkmsg_path = "{tmp_path}/kmsg"\nstate_dir = "{tmp_path}"\n'
        f'status_socket = "{sock}"\nstall_timeout_s = 1.0\n'
    )
    env = fake_nvml_env(build_fake_nvml(tmp_path / "lib"), ctl)
    env.pop("NOTIFY_SOCKET", None)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "resild.cli", "daemon", "--config", str(conf)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    step = [0]
    link = AgentLink(f"ipc://{sock}", "n1/rank0", lambda: step[0], interval_s=0.1, timeout_s=0.5)
    try:
        link.start()

        def mine() -> dict | None:
            rep = local_request(f"ipc://{sock}", MsgType.STATUS, timeout_s=1.0)
            procs = rep.body.get("processes", []) if rep else []
            return next((p for p in procs if p.get("name") == "n1/rank0"), None)

        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            step[0] += 1
            p = mine()
            if p is not None and (p.get("step") or 0) >= 2:
                break
            time.sleep(0.1)
        assert p is not None and (p.get("step") or 0) >= 2, p
        # Training stops advancing: the daemon must call it hung after stall_timeout_s.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            p = mine()
            if p and p.get("state") == "hung":
                break
            time.sleep(0.2)
        assert p and p.get("state") == "hung", p
    finally:
        link.stop()
        daemon.terminate()
        daemon.wait(10)
