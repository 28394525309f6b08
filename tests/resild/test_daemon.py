from __future__ import annotations

import configparser
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import zmq

from resild.config import Config
from resild.daemon import Agent, ProcState, Watched, judge_process, local_request, sd_notify, watchdog_interval_s
from resild.health.fakenvml import build_fake_nvml, fake_nvml_env
from resild.health.model import Verdict
from resild.probes import ProbeResult, ProbeRunner, aggregate
from resild.protocol import MsgType
from resild.transport import KeyDir, Server, generate_keys

REPO = Path(__file__).resolve().parents[2]
RESILD = [sys.executable, "-m", "resild.cli"]


# -- fail-closed probe running -----------------------------------------------------------

class Flip:
    name = "flip"

    def __init__(self) -> None:
        self.verdict = Verdict.HEALTHY
        self.mode = "ok"

    def check(self) -> ProbeResult:
        if self.mode == "raise":
            raise RuntimeError("sensor exploded")
        if self.mode == "hang":
            time.sleep(1.0)
        if self.mode == "junk":
            return "fine"  # type: ignore[return-value]
        return ProbeResult(self.verdict, [] if self.verdict is Verdict.HEALTHY else ["flip is broken"])


@pytest.mark.parametrize("mode, why", [("raise", "raised RuntimeError: sensor exploded"),
                                       ("hang", "timed out after 0.2s"),
                                       ("junk", "returned str, not a ProbeResult")])
def test_probe_that_misbehaves_is_failed(mode: str, why: str) -> None:
    p = Flip()
    p.mode = mode
    r = ProbeRunner(p, timeout_s=0.2)
    out = r.run()
    assert out.error and out.result.verdict is Verdict.FAILED and why in out.result.reasons[0]
    if mode == "hang":   # still stuck: not run again, still FAILED
        again = r.run()
        assert again.result.verdict is Verdict.FAILED and "still stuck" in again.result.reasons[0]


def test_aggregate_worst_with_reasons() -> None:
    v, reasons = aggregate({"a": ProbeResult(Verdict.HEALTHY), "b": ProbeResult(Verdict.DEGRADED, ["b slow"]),
                            "c": ProbeResult(Verdict.FAILED, ["c dead"])})
    assert v is Verdict.FAILED and reasons == ["b slow", "c dead"]


# -- pure process judgement ---------------------------------------------------------------

def test_judge_process() -> None:
    w = Watched(pid=10, name="train", create_time=0.0, last_progress_s=100.0)
    assert judge_process(150.0, w, True, False, 60.0)[0] is ProcState.RUNNING
    state, why = judge_process(161.0, w, True, False, 60.0)
    assert state is ProcState.HUNG and "no progress for 61s" in why
    assert judge_process(101.0, w, True, True, 60.0)[0] is ProcState.ZOMBIE
    assert judge_process(101.0, w, False, False, 60.0)[0] is ProcState.EXITED
    w.state = ProcState.EXITED   # exit is final, even if the pid shows up again
    assert judge_process(101.0, w, True, False, 60.0)[0] is ProcState.EXITED


# -- systemd ---------------------------------------------------------------------------

def test_sd_notify_and_watchdog(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        assert sd_notify("READY=1", {"NOTIFY_SOCKET": path})
        assert s.recv(100) == b"READY=1"
    assert not sd_notify("READY=1", {})
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({}) is None


def test_systemd_unit() -> None:
    unit = REPO / "systemd" / "resild.service"
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(unit.read_text())
    svc = cp["Service"]
    assert svc["Type"] == "notify" and svc["Restart"] == "on-failure"
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["StateDirectory"] == "resild" and svc["ConfigurationDirectory"] == "resild"
    assert svc["WatchdogSec"] and "/run/resild" in svc["ReadWritePaths"]
    assert svc["ExecStart"] == "/usr/local/bin/resild daemon --config /etc/resild/resild.toml"
    analyze = shutil.which("systemd-analyze")
    exe = shutil.which("resild", path=str(Path(sys.executable).parent))
    if analyze is None or exe is None:
        pytest.skip("systemd-analyze not available: parser check only")
    local = Path(os.environ.get("TMPDIR", "/tmp")) / f"resild-verify-{os.getpid()}.service"
    local.write_text(unit.read_text().replace("/usr/local/bin/resild", exe))
    try:
        proc = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=30)
    finally:
        local.unlink()
    assert proc.returncode == 0 and local.name not in proc.stderr, proc.stderr


# -- the agent in-process, against a real ROUTER ------------------------------------------

def test_agent_reports_health_and_heartbeats_and_watches(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys", nodes=["n1"])
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0", keys)
    cfg = Config(controller=server.endpoint, keys_dir=str(keys.node("n1").path), node="n1", heartbeat_s=0.2,
                 probe_interval_s=30, hang_timeout_s=0.6, state_dir=str(tmp_path),
                 status_socket=str(tmp_path / "s.sock"))
    flip = Flip()
    agent = Agent(cfg, probes=[flip], ctx=ctx)
    agent.start()
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        def expect(mtype: MsgType, timeout_s: float = 3.0) -> dict:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                got = server.channel.recv(0.1)
                if got is not None and got[1].type is mtype:
                    return got[1].body
            raise AssertionError(f"no {mtype.value} within {timeout_s}s")

        assert expect(MsgType.HEALTH) == {"node": "n1", "verdict": "healthy", "reasons": [],
                                          "detector": "resild-agent"}
        assert expect(MsgType.HEARTBEAT)["health"] == "healthy"
        flip.verdict = Verdict.FAILED
        t0 = time.monotonic()
        agent._trigger.set()   # what an NVML event does
        body = expect(MsgType.HEALTH)
        assert body["verdict"] == "failed" and body["reasons"] == ["flip is broken"]
        assert time.monotonic() - t0 < 1.0

        ep = cfg.status_endpoint
        reply = local_request(ep, MsgType.REGISTER_WORKER, {"pid": sleeper.pid, "name": "train.py"})
        assert reply is not None and reply.body == {"ok": True}
        bad = local_request(ep, MsgType.REGISTER_WORKER, {"pid": "x"})
        assert bad is not None and bad.type is MsgType.ERROR
        time.sleep(1.3)   # > hang_timeout_s without progress
        st = local_request(ep, MsgType.STATUS).body
        assert st["verdict"] == "failed" and st["processes"][0]["state"] == "hung"
        assert local_request(ep, MsgType.PROGRESS, {"pid": sleeper.pid, "step": 7}).body == {"ok": True}
        sleeper.kill()
        sleeper.wait()
        time.sleep(0.8)
        [proc] = local_request(ep, MsgType.STATUS).body["processes"]
        assert proc["state"] == "exited" and proc["step"] == 7
        assert json.loads((tmp_path / "last_status.json").read_text())["node"] == "n1"
    finally:
        sleeper.kill()
        agent.close()
        t.join(2)
        server.close()
        ctx.term()


# -- `resild daemon` + `resild status --json` with the fake NVML -------------------------

@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


def test_daemon_status_turns_failed_on_xid79(tmp_path: Path, fake_nvml_dir: Path) -> None:
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 2\n")
    (tmp_path / "kmsg").write_text("")
    conf = tmp_path / "resild.toml"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf.write_text(f'node = "gpu-n1"\nmetrics_port = {port}\nkmsg_path = "{tmp_path}/kmsg"\nstate_dir = "{tmp_path}"\n'
                    f'status_socket = "{tmp_path}/status.sock"\nprobe_interval_s = 30\n')
    env = fake_nvml_env(fake_nvml_dir, ctl)
    env.pop("NOTIFY_SOCKET", None)
    daemon = subprocess.Popen([*RESILD, "daemon", "--config", str(conf)], env=env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def status() -> tuple[int, dict]:
        p = subprocess.run([*RESILD, "status", "--config", str(conf), "--json", "--timeout", "2"],
                           env=env, capture_output=True, text=True, timeout=20)
        return p.returncode, (json.loads(p.stdout) if p.stdout else {"stderr": p.stderr})

    try:
        deadline = time.monotonic() + 15
        while True:
            rc, body = status()
            if rc != 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert rc == 0, body
        assert body["verdict"] == "healthy" and len(body["gpus"]) == 2
        with open(ctl, "a") as f:
            f.write("event 1 xid 79\n")
        t0 = time.monotonic()
        while True:
            rc, body = status()
            if rc == 2 or time.monotonic() - t0 > 3:
                break
        assert rc == 2 and body["verdict"] == "failed", body
        assert time.monotonic() - t0 < 3.0
        gpu1 = body["gpus"][1]
        assert gpu1["verdict"] == "failed" and gpu1["last_xid"] == 79
        assert any("Xid 79" in r for r in body["reasons"])
        text = subprocess.run([*RESILD, "status", "--config", str(conf)], env=env,
                              capture_output=True, text=True, timeout=20)
        assert text.returncode == 2 and "node gpu-n1: FAILED" in text.stdout and "79 @" in text.stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'resild_xid_total{code="79",gpu="1",node="gpu-n1"} 1.0' in metrics
        assert 'resild_node_verdict{node="gpu-n1"} 2.0' in metrics
        assert 'resild_gpu_verdict{gpu="1",node="gpu-n1",uuid="GPU-' in metrics
        assert 'resild_probe_latency_seconds_count{node="gpu-n1",probe="gpu"}' in metrics
    finally:
        daemon.terminate()
        out, _ = daemon.communicate(timeout=10)
    assert daemon.returncode == 0, out
    assert "Traceback" not in out
    assert not (tmp_path / "status.sock").exists()
