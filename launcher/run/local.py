"""Embedded local cluster: one node process per simulated node on this machine.

Each node process leads its own process group, so fencing a node is one
killpg; each may get its own fault-injecting NVML stand-in (a control file
that the node's GPU probe reads through the real nvidia-ml-py binding).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import resild.wire.env as resild_env
from launcher.node.command import node_command
from resild.controller.backend import Backend
from resild.procutil import die_with_parent
from resild.wire.keys import KeyDir, add_node_key
from resild.wire.settings import JobSettings

log = logging.getLogger("resild.local")


class LocalCluster(Backend):
    def __init__(
        self,
        nodes: list[str],
        nproc: int,
        cmd: list[str],
        run_dir: Path,
        fake_nvml_dir: Path | None = None,
        gpus_per_node: int = 0,
        settings: JobSettings | None = None,
        qualify: bool = False,
    ) -> None:
        self.settings = settings or JobSettings()
        self.qualify = qualify  # nodes joining a running job: `resild check --qualify` before they register
        self.nodes, self.nproc, self.cmd, self.run_dir = nodes, nproc, cmd, run_dir
        self.fake_nvml_dir = fake_nvml_dir
        self.gpus_per_node = gpus_per_node
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._expected_exit: set[str] = set()
        self._reported: set[str] = set()
        # set by start: a re-admitted node starts the same way
        self._controller: str = ""
        self._keys_dir: Path | None = None

    def start(self, controller: str, keys_dir: Path | None, minted: bool = False) -> None:
        """`minted`: the controller made the nodes' keys already (nodes joining a running job)."""
        # One key pair per node, all made before any node starts: each node process (and
        # its workers, through RESILD_KEYS) gets a directory with only its own secret key,
        # and the controller knows the node by that key (ZAP User-Id), not by what it says.
        node_keys = {}
        if keys_dir is not None:
            kd = KeyDir(keys_dir)
            node_keys = {n: kd.node(n).path if minted else add_node_key(kd, n).path for n in self.nodes}
        self._controller, self._keys_dir = controller, keys_dir
        for node in self.nodes:
            self._start(node, node_keys.get(node), self.qualify)

    def _start(self, node: str, key_path: Path | None, qualify: bool) -> None:
        """One node process, leading its own process group (fencing is one killpg)."""
        env = node_env(os.environ)
        control = None
        if self.fake_nvml_dir is not None:
            control = self.run_dir / f"nvml-{node}.ctl"
            extra = [x.strip() for x in os.environ.get(resild_env.LOCAL_NVML.name, "").split(";") if x.strip()]
            control.write_text("\n".join([f"gpus {max(1, self.gpus_per_node)}", *extra]) + "\n")
            env["LD_LIBRARY_PATH"] = f"{self.fake_nvml_dir}:{env.get('LD_LIBRARY_PATH', '')}"
            env["FAKE_NVML_CONTROL"] = str(control)
        argv = node_command(
            self._controller,
            self.nproc,
            self.settings.to_dict(),
            self.cmd,
            node=node,
            keys=key_path,
            qualify=qualify,
            nvml_control=control,
        )
        self.procs[node] = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)

    def restartable(self) -> frozenset[str]:
        """Our nodes whose node process has exited (fenced: killed; its process group with it)."""
        return frozenset(n for n, p in self.procs.items() if p.poll() is not None)

    def readmit(self, node: str) -> None:
        """The node back as a spare: a new node process with the key the controller just
        minted, qualifying before it registers."""
        self._expected_exit.discard(node)
        self._reported.discard(node)
        key = KeyDir(self._keys_dir).node(node).path if self._keys_dir is not None else None
        self._start(node, key, qualify=True)

    def fence(self, node: str, reason: str) -> None:
        self._expected_exit.add(node)
        p = self.procs.get(node)
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # node process and every worker it started
            except ProcessLookupError:
                pass

    def exited_nodes(self) -> list[tuple[str, int]]:
        out = []
        for node, p in self.procs.items():
            rc = p.poll()
            if rc is not None and node not in self._expected_exit and node not in self._reported:
                self._reported.add(node)
                out.append((node, rc))
        return out

    def shutdown(self, timeout_s: float) -> None:
        self._expected_exit.update(self.procs)
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # also reaps stopped or stray workers
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


def node_env(base: Mapping[str, str]) -> dict[str, str]:
    """A local node process's environment (its workers inherit it): never another key
    directory; gloo bound to loopback unless the job says otherwise (every node of an
    embedded cluster is on this host: no other host needs to reach a pair listener)."""
    env = dict(base)
    env.pop(resild_env.KEYS.name, None)
    env.setdefault(resild_env.GLOO_HOST.name, "127.0.0.1")
    return env
