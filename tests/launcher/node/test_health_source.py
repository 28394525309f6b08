"""One health source per node (launcher/node/health_source.py): the node daemon's verdict
when it runs, else the daemon's probe set built from the same config, in-process.

Real processes throughout: `resild daemon` with the fake NVML library, and the
health source in a child process (the fake library is found through LD_LIBRARY_PATH,
which only a fresh process reads).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from launcher.node.health_source import DAEMON_SOCKET_ENV, DaemonHealth, InProcessHealth, open_health_source
from resild.health.fakenvml import build_fake_nvml, fake_nvml_env
from resild.wire.local_socket import local_request
from resild.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[3]

# The node process's side, alone: open the source, report what it is and every change.
HELPER = r"""
import json, sys
from launcher.node.health_source import open_health_source

def emit(kind, **kw):
    print(json.dumps({"kind": kind, **kw}), flush=True)

def nvml_loaded():
    return "libnvidia-ml" in open("/proc/self/maps").read() or "pynvml" in sys.modules

src = open_health_source(sys.argv[1], lambda body: emit("change", body=body), sys.argv[2] or None, interval_s=0.5)
emit("opened", type=type(src).__name__, poll=src.poll(), nvml=nvml_loaded(),
     probes=[p.name for p in getattr(src, "probes", [])])
sys.stdin.readline()
emit("closing", nvml=nvml_loaded())
src.stop()
"""


class Helper:
    def __init__(self, env: dict[str, str], nvml_control: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HELPER, "n1", str(nvml_control or "")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def expect(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if pred(msg):
                return msg
        raise AssertionError(f"nothing matched within {timeout_s}s; stderr: {self.stderr_now()}")

    def stderr_now(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def close(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        closing = self.expect(lambda m: m["kind"] == "closing")
        self.proc.wait(10)
        return closing

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def change(verdict: str) -> Callable[[dict[str, Any]], bool]:
    return lambda m: m["kind"] == "change" and m["body"]["verdict"] == verdict


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


def _conf(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "kmsg").write_text("")
    conf = tmp_path / "resild.toml"
    conf.write_text(
        f'node = "gpu-n1"\nkmsg_path = "{tmp_path}/kmsg"\nstate_dir = "{tmp_path}"\n'
        f'status_socket = "{tmp_path}/status.sock"\nstatus_group = ""\nprobe_interval_s = 30\n{extra}'
    )
    return conf


def _env(fake_nvml_dir: Path, ctl: Path, conf: Path, **extra: str) -> dict[str, str]:
    env = fake_nvml_env(fake_nvml_dir, ctl)
    for k in [k for k in env if k.startswith("RESILD_")]:
        del env[k]
    env.update(RESILD_CONFIG=str(conf), PYTHONUNBUFFERED="1", **extra)
    env.pop("NOTIFY_SOCKET", None)
    return env


def _start_daemon(conf: Path, env: dict[str, str], tmp_path: Path) -> subprocess.Popen:
    d = subprocess.Popen(
        [sys.executable, "-m", "resild.cli", "daemon", "--config", str(conf)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 20
    while local_request(f"ipc://{tmp_path}/status.sock", MsgType.STATUS, timeout_s=0.5) is None:
        assert d.poll() is None and time.monotonic() < deadline, d.stdout.read() if d.stdout else ""
        time.sleep(0.1)
    return d


def _stop_daemon(d: subprocess.Popen) -> str:
    d.terminate()
    out, _ = d.communicate(timeout=10)
    return out


def test_with_a_daemon_the_job_subscribes_and_opens_nvml_only_while_it_is_gone(
    tmp_path: Path, fake_nvml_dir: Path
) -> None:
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 2\n")
    conf = _conf(tmp_path)
    # The child could load the fake NVML (same environment as the daemon): it must not.
    env = _env(fake_nvml_dir, ctl, conf)
    daemon = _start_daemon(conf, env, tmp_path)
    helper = Helper(env)  # the socket comes from the config, as the daemon reads it
    try:
        opened = helper.expect(lambda m: m["kind"] == "opened")
        assert opened["type"] == "DaemonHealth" and not opened["nvml"]  # the daemon answers: no NVML here
        assert opened["poll"] == {"verdict": "healthy", "reasons": [], "detector": "daemon"}
        with open(ctl, "a") as f:
            f.write("event 1 xid 79\n")
        t0 = time.monotonic()
        failed = helper.expect(change("failed"), timeout_s=5)["body"]
        assert time.monotonic() - t0 < 2.0
        assert failed["detector"] == "daemon" and any("Xid 79" in r for r in failed["reasons"])
        # The daemon goes away: "unknown" at once, not a crash, then the same probes in-process,
        # so an Xid while it is away is not hidden (issue 39: it stayed "unknown" through one);
        # it comes back: subscribed again, its verdict the node's.
        _stop_daemon(daemon)
        lost = helper.expect(change("unknown"), timeout_s=5)["body"]
        assert "node daemon" in lost["reasons"][0]
        helper.expect(lambda m: m["kind"] == "change" and m["body"]["detector"] != "daemon", timeout_s=10)
        with open(ctl, "a") as f:
            f.write("event 0 xid 79\n")
        meanwhile = helper.expect(change("failed"), timeout_s=10)["body"]
        assert meanwhile["detector"] != "daemon" and any("gpu0" in r and "Xid 79" in r for r in meanwhile["reasons"])
        daemon = _start_daemon(conf, env, tmp_path)
        back = helper.expect(lambda m: m["kind"] == "change" and m["body"]["detector"] == "daemon", timeout_s=15)
        assert back["body"]["verdict"] != "unknown"
        helper.close()
        assert helper.proc.returncode == 0, helper.stderr_now()
    finally:
        helper.kill()
        out = _stop_daemon(daemon)
    assert "Traceback" not in out


@pytest.mark.parametrize("override, verdict", [("", "failed"), ('xid_overrides = { "79" = "degraded" }', "degraded")])
def test_without_a_daemon_the_simulated_node_runs_the_configured_probes(
    tmp_path: Path, fake_nvml_dir: Path, override: str, verdict: str
) -> None:
    """The local demo's path: `--inject xid79:nodeN` through the NVML stand-in turns into a
    HEALTH change within ~1 s, judged with the config's Xid overrides."""
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 2\n")
    conf = _conf(tmp_path, override)
    helper = Helper(_env(fake_nvml_dir, ctl, conf, **{DAEMON_SOCKET_ENV: ""}), nvml_control=ctl)
    try:
        opened = helper.expect(lambda m: m["kind"] == "opened")
        assert opened["type"] == "InProcessHealth" and opened["nvml"]
        assert opened["probes"] == ["gpu"]  # no host kernel log for a simulated node
        assert opened["poll"]["verdict"] == "healthy"
        with open(ctl, "a") as f:
            f.write("event 1 xid 79\n")
        t0 = time.monotonic()
        body = helper.expect(change(verdict), timeout_s=5)["body"]
        assert time.monotonic() - t0 < 1.0
        assert body["detector"] == "nvml-xid" and any("Xid 79" in r for r in body["reasons"])
        helper.close()
        assert helper.proc.returncode == 0, helper.stderr_now()
    finally:
        helper.kill()


def test_without_a_daemon_a_real_node_follows_the_kernel_log_with_overrides(
    tmp_path: Path, fake_nvml_dir: Path
) -> None:
    """Not simulated: the configured kernel log is followed too, and an override makes
    Xid 43 (an application error by default) fail the node."""
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 1\n")
    conf = _conf(tmp_path, 'xid_overrides = { "43" = "failed" }')
    helper = Helper(_env(fake_nvml_dir, ctl, conf, **{DAEMON_SOCKET_ENV: str(tmp_path / "no-daemon.sock")}))
    try:
        opened = helper.expect(lambda m: m["kind"] == "opened")
        assert opened["type"] == "InProcessHealth" and opened["probes"] == ["gpu", "kmsg"]
        with open(tmp_path / "kmsg", "a") as f:
            f.write("NVRM: Xid (PCI:0000:99:00): 43, pid=1234, name=python, Ch 00000008\n")
        body = helper.expect(change("failed"), timeout_s=5)["body"]
        assert body["detector"] == "kmsg-xid" and any("Xid 43" in r for r in body["reasons"])
        helper.close()
    finally:
        helper.kill()


def test_without_nvml_or_a_readable_kernel_log_the_node_is_not_failed(tmp_path: Path) -> None:
    conf = _conf(tmp_path)  # probes gpu and kmsg; the environment points kmsg at no file
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILD_", "FAKE_NVML", "LD_LIBRARY_PATH"))}
    env.update(
        RESILD_CONFIG=str(conf),
        RESILD_CFG_KMSG_PATH=str(tmp_path / "missing"),
        **{DAEMON_SOCKET_ENV: str(tmp_path / "no-daemon.sock")},
    )
    helper = Helper(env)
    try:
        opened = helper.expect(lambda m: m["kind"] == "opened")
        assert opened["type"] == "InProcessHealth"
        if ctypes.util.find_library("nvidia-ml") is None:  # a machine without a GPU driver
            assert opened["probes"] == [] and opened["poll"] is None
        else:  # a real GPU here: its probe runs, the unreadable log is still left out
            assert opened["probes"] == ["gpu"]
        helper.close()
    finally:
        helper.kill()


def test_plugin_probes_from_the_config_apply_in_process(tmp_path: Path) -> None:
    conf = _conf(
        tmp_path,
        f'probes = ["diskspace"]\n[probe_options.diskspace]\npaths = ["{tmp_path}"]\n'
        "failed_free_bytes = 1152921504606846976\n",
    )  # 1 EiB free: never
    changes: list[dict] = []
    src = open_health_source(
        "n1", changes.append, env={"RESILD_CONFIG": str(conf), DAEMON_SOCKET_ENV: str(tmp_path / "none.sock")}
    )
    try:
        assert isinstance(src, InProcessHealth) and [p.name for p in src.probes] == ["diskspace"]
        body = src.poll()
        assert body is not None and body["verdict"] == "failed" and body["detector"] == "probe-poll"
        assert changes == [body]
    finally:
        src.stop()


def test_a_bad_config_is_reported_unknown_not_raised(tmp_path: Path) -> None:
    conf = tmp_path / "resild.toml"
    conf.write_text("hearbeat_s = 2\n")
    changes: list[dict] = []
    src = open_health_source(
        "n1", changes.append, env={"RESILD_CONFIG": str(conf), DAEMON_SOCKET_ENV: str(tmp_path / "none.sock")}
    )
    src.stop()
    assert isinstance(src, InProcessHealth)
    assert changes and changes[0]["verdict"] == "unknown" and "hearbeat_s" in changes[0]["reasons"][0]


def test_a_stale_daemon_socket_falls_back_to_in_process(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # a dead daemon's socket file: nothing listens
    conf = _conf(tmp_path, "probes = []\n")
    src = open_health_source("n1", lambda b: None, env={"RESILD_CONFIG": str(conf), DAEMON_SOCKET_ENV: str(stale)})
    src.stop()
    assert isinstance(src, InProcessHealth) and not isinstance(src, DaemonHealth) and src.poll() is None
