from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from resild.controller.loop import Controller, ControllerConfig, JobResult
from resild.events.log import EventLog
from resild.health.fakenvml import build_fake_nvml, fake_nvml_env
from resild.wire.keys import generate_keys

RESILD = [sys.executable, "-m", "resild.cli"]
XID79 = "NVRM: Xid (PCI:0000:{bus}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


def run(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*RESILD, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


@pytest.fixture
def node(tmp_path: Path, fake_nvml_dir: Path):
    """A fake 4-GPU node: control file, kernel log, config and env for `resild check`."""
    ctl = tmp_path / "nvml.ctl"
    ctl.write_text("gpus 4\n")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("[ 1.0] an unrelated line\n")
    conf = tmp_path / "resild.toml"
    conf.write_text(f'node = "gpu-n7"\nkmsg_path = "{kmsg}"\nstatus_socket = "{tmp_path}/s.sock"\n')
    env = fake_nvml_env(fake_nvml_dir, ctl)
    return ctl, kmsg, conf, env


def test_check_healthy_exit_0(node) -> None:
    ctl, kmsg, conf, env = node
    p = run("check", "--config", str(conf), env=env)
    assert p.returncode == 0, p.stderr
    assert "node gpu-n7: HEALTHY" in p.stdout and "GPU-" in p.stdout


def test_check_degraded_exit_1(node) -> None:
    ctl, kmsg, conf, env = node
    ctl.write_text("gpus 4\nset 2 remap_pending 1\n")
    p = run("check", "--config", str(conf), "--json", env=env)
    assert p.returncode == 1, p.stderr
    body = json.loads(p.stdout)
    assert body["verdict"] == "degraded" and body["reasons"][0].startswith("gpu2: row remap pending")


def test_check_xid79_exit_2_and_drain(node, tmp_path: Path) -> None:
    ctl, kmsg, conf, env = node
    # GPU 3 sits on PCI bus 0x40 in the fake (bus = (index+1)*0x10).
    kmsg.write_text(kmsg.read_text() + XID79.format(bus="40") + "\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    scontrol = bindir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/scontrol.args\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = dict(env, PATH=f"{bindir}:{env['PATH']}")
    p = run("check", "--config", str(conf), "--drain", env=env)
    assert p.returncode == 2, p.stderr
    assert "gpu3: Xid 79 (GPU has fallen off the bus)" in p.stdout
    args = (tmp_path / "scontrol.args").read_text().splitlines()
    assert args == [
        "update",
        "NodeName=gpu-n7",
        "State=DRAIN",
        "Reason=resild: GPU 3 Xid 79 GPU has fallen off the bus",
    ]


def test_check_qualify_passes_a_healthy_node_after_its_self_test(node) -> None:
    ctl, kmsg, conf, env = node
    p = run("check", "--config", str(conf), "--qualify", "--json", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    body = json.loads(p.stdout)
    assert body["qualified"] and body["qualification"] == []
    (dev,) = body["selftest"]["devices"]  # the CPU lab: the self-test runs on the CPU
    assert dev["device"] == "cpu" and dev["ok"] and dev["copy_ok"] and dev["matmul_rel_err"] < 1e-4


def test_check_qualify_refuses_a_node_that_is_only_degraded(node) -> None:
    ctl, kmsg, conf, env = node
    ctl.write_text("gpus 4\nset 2 remap_pending 1\n")  # usable for work it holds, not for new work
    p = run("check", "--config", str(conf), "--qualify", env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "qualification: NOT QUALIFIED" in p.stdout
    assert "health degraded: gpu2: row remap pending" in p.stdout


def test_check_without_nvml_fails_closed(tmp_path: Path) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))  # no libnvidia-ml here
    conf = tmp_path / "c.toml"
    conf.write_text(f'kmsg_path = "{tmp_path}/none"\n')
    p = run("check", "--config", str(conf), "--json", env=env)
    body = json.loads(p.stdout)
    assert p.returncode == 2 and body["probes"]["gpu"]["verdict"] == "failed"
    assert body["probes"]["kmsg"]["verdict"] == "degraded"  # unreadable log: blind, not broken


def test_user_mistakes_are_one_line_no_traceback(tmp_path: Path) -> None:
    conf = tmp_path / "resild.toml"
    conf.write_text("hearbeat_s = 1\n")
    for cmd in (["daemon"], ["check"], ["status"]):
        p = run(*cmd, "--config", str(conf))
        assert p.returncode == 2
        assert p.stderr == f"resild: {conf}: unknown key 'hearbeat_s' (did you mean 'heartbeat_s'?)\n"
    p = run("check", "--probes", "gpu,infiniband,gpuu", "--config", str(tmp_path / "absent.toml"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "absent.toml: no such file" in p.stderr
    conf.write_text("")
    p = run("check", "--probes", "gpuu", "--config", str(conf))
    assert p.returncode == 2 and "unknown probe 'gpuu' (available: diskspace, gpu, infiniband, kmsg)" in p.stderr
    assert "Traceback" not in p.stderr


def test_status_without_daemon_exit_3(tmp_path: Path) -> None:
    p = run(
        "status",
        "--socket",
        str(tmp_path / "nobody.sock"),
        "--timeout",
        "0.3",
        "--config",
        str(tmp_path / "x.toml"),
        env=dict(os.environ),
    )
    # An explicit missing config is a config error; without --config, only the socket matters.
    assert p.returncode == 2
    p = run(
        "status",
        "--socket",
        str(tmp_path / "nobody.sock"),
        "--timeout",
        "0.3",
        env={k: v for k, v in os.environ.items() if k != "RESILD_CONFIG"},
    )
    assert p.returncode == 3
    assert p.stderr.strip() == (
        f"resild: no resild daemon answered on ipc://{tmp_path}/nobody.sock within 0.3s (is `resild daemon` running?)"
    )


def test_cluster_against_real_controller(tmp_path: Path) -> None:
    keys = generate_keys(tmp_path / "keys")
    ctrl = Controller(
        ControllerConfig(bind="tcp://127.0.0.1:0"),
        active=["n1", "n2"],
        spares=["n3"],
        nproc_per_node=2,
        keys=keys,
        events=EventLog(None),
    )
    t = threading.Thread(target=ctrl.run, daemon=True)
    t.start()
    try:
        p = run("cluster", "--controller", ctrl.endpoint, "--keys", str(keys.path))
        assert p.returncode == 0, p.stderr
        # the job's width and the pool: n3 is a spare that has not registered yet (starting)
        assert (
            p.stdout.splitlines()[0] == "epoch 0, committed step 0, 4 of 4 ranks, spares: 0 hot, 1 starting, 0 queued"
        )
        assert "NODE" in p.stdout and "spare" in p.stdout
        p = run("cluster", "--controller", ctrl.endpoint, "--keys", str(keys.path), "--json")
        body = json.loads(p.stdout)
        assert [n["node"] for n in body["nodes"]] == ["n1", "n2", "n3"]
        assert {n["role"] for n in body["nodes"]} == {"active", "spare"}
        assert body["pool"] == {"hot": 0, "starting": 1, "queued": 0, "target": 0}
        assert (body["world_size"], body["full_world"]) == (4, 4)
        # Without keys a CURVE controller never answers: one line, exit 3.
        p = run("cluster", "--controller", ctrl.endpoint, "--timeout", "0.5")
        assert p.returncode == 3 and p.stderr.count("\n") == 1 and "no controller answered" in p.stderr
    finally:
        ctrl.result = JobResult(0, "test over")
        t.join(5)


def test_keys(tmp_path: Path) -> None:
    d = tmp_path / "k"
    p = run("keys", str(d))
    assert p.returncode == 0, p.stderr
    assert (d / "server.key_secret").stat().st_mode & 0o777 == 0o600
    assert (d / "authorized" / "client.key").exists()
    p = run("keys", str(d))
    assert p.returncode == 2 and "already holds keys" in p.stderr


@pytest.mark.parametrize("cmd", ["daemon", "status", "check", "cluster", "keys"])
def test_help_has_an_example(cmd: str) -> None:
    p = run(cmd, "--help")
    assert p.returncode == 0 and "Example" in p.stdout and f"resild {cmd}" in p.stdout


@pytest.mark.parametrize("timeout", ["1e308", "3601", "0", "-1"])
def test_status_with_an_absurd_timeout_is_one_line_exit_2(tmp_path: Path, timeout: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RESILD_CONFIG"}
    p = run("status", "--socket", str(tmp_path / "nobody.sock"), "--timeout", timeout, env=env)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1 and "status_timeout_s" in p.stderr
