"""The job's own etcd cluster (resil-run --controllers N without --etcd): N members,
their data on disk (not in the run directory: see LocalEtcd), client and peer TLS with the job's CA only
(client certificates required), requests bounded (--max-request-bytes) and the store
bounded (--quota-backend-bytes).

`LocalEtcd` runs the members on this machine (resil-run --local), bound to loopback, on
ports picked free once and kept in RUN_DIR/etcd/cluster.json (with where their data is:
$TMPDIR/resild-etcd-<run>/): a resumed job restarts the same members on the same data.
Members die with the process that started them.

Under Slurm each member runs on its own host (one srun step on the allocation's first
nodes, the replicas' hosts):

    python -m resild.controller.etcd_cluster --run-dir RUN_DIR --keys KEYS --hosts h1,h2,h3

picks its ports there, publishes them in the (shared) run directory, waits for every
member's, makes its own certificate (the job's CA signs it) and becomes etcd (exec), its
data on the host's local disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from resild.controller.etcd_client import Etcd, EtcdError
from resild.controller.etcd_target import EtcdTarget
from resild.controller.etcd_tls import EtcdCerts, make_certs, member_cert_for
from resild.procutil import die_with_parent, say, stop_group
from resild.wire import env as resild_env
from resild.wire.own_dir import NotOwnError, private_dir
from resild.wire.store import listen_address

MAX_REQUEST_BYTES = 3 * 512 * 1024  # 1.5 MiB: one journal record (1 MiB, base64'd) fits, nothing much larger
QUOTA_BACKEND_BYTES = 512 * 1024 * 1024  # the journal of a long job is a few MiB
# Raft timing of the members (ms). A lease's TTL is at least 1.5 election timeouts: with
# 500 ms a 1 s TTL is granted, so a dead leader is replaced within ~1-1.5 s.
HEARTBEAT_MS = 50
ELECTION_MS = 500


@dataclass(frozen=True)
class Member:
    name: str
    host: str
    client_port: int
    peer_port: int

    listen: str = ""  # the address listened on, if not `host`'s (Slurm: the host's job address)

    @property
    def client_url(self) -> str:
        return f"https://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"https://{self.host}:{self.peer_port}"

    def _listen(self, port: int) -> str:
        host = self.listen or self.host
        return f"https://{f'[{host}]' if ':' in host else host}:{port}"


def etcd_binary() -> str | None:
    return shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def member_cmd(
    binary: str, me: Member, members: list[Member], data_dir: Path, certs: EtcdCerts, token: str
) -> list[str]:
    cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    return [
        binary,
        "--name",
        me.name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        me._listen(me.client_port),
        "--advertise-client-urls",
        me.client_url,
        "--listen-peer-urls",
        me._listen(me.peer_port),
        "--initial-advertise-peer-urls",
        me.peer_url,
        "--initial-cluster",
        cluster,
        "--initial-cluster-state",
        "new",  # ignored once the data directory holds the member (a restart)
        "--initial-cluster-token",
        token,
        "--client-cert-auth",
        "--trusted-ca-file",
        str(certs.ca),
        "--cert-file",
        str(certs.member_cert),
        "--key-file",
        str(certs.member_key),
        "--peer-client-cert-auth",
        "--peer-trusted-ca-file",
        str(certs.ca),
        "--peer-cert-file",
        str(certs.member_cert),
        "--peer-key-file",
        str(certs.member_key),
        "--max-request-bytes",
        str(MAX_REQUEST_BYTES),
        "--quota-backend-bytes",
        str(QUOTA_BACKEND_BYTES),
        "--heartbeat-interval",
        str(HEARTBEAT_MS),
        "--election-timeout",
        str(ELECTION_MS),
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "10000",
        "--logger",
        "zap",
        "--log-outputs",
        "stderr",
    ]


def _free_ports(host: str, n: int) -> list[int]:
    """n distinct free ports: every probe socket stays bound until all are picked (one released
    at once can come back from the kernel for the next bind: seen as a member's client port
    equal to another's peer port, and a member that cannot start)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


RESTART_BACKOFF_S = 2.0  # a member that keeps dying is started again no more often than this


class LocalEtcd:
    """N etcd members on this machine, on loopback."""

    def __init__(
        self,
        run_dir: Path,
        keys_dir: Path,
        n: int = 3,
        job: str | None = None,
        host: str = "127.0.0.1",
        *,
        fresh: bool = False,
        data_root: Path | None = None,
    ) -> None:
        """`fresh`: a new job in this run directory, whatever an earlier one left there
        (its members' data goes); otherwise an existing cluster is started again as it was.
        `data_root`: where the members keep their data (default: $TMPDIR/resild-etcd-<run>;
        not the run directory: a full run directory must not stop etcd, whose members exit
        on a failed write)."""
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.dir = run_dir / "etcd"
        layout = self.dir / "cluster.json"
        if fresh and layout.exists():  # an earlier job's members: their data goes too
            try:
                shutil.rmtree(json.loads(layout.read_text())["data"], ignore_errors=True)
            except (OSError, ValueError, KeyError):
                pass
        if fresh and self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.certs = make_certs(keys_dir)
        if layout.exists():  # a resumed job: the same members, ports and data
            saved = json.loads(layout.read_text())
            self.members = [Member(**m) for m in saved["members"]]
            self.token = str(saved["token"])
            self.job = str(saved["job"])
            self.data = Path(saved["data"])
        else:
            ports = _free_ports(host, 2 * n)
            self.members = [Member(f"m{i}", host, ports[2 * i], ports[2 * i + 1]) for i in range(n)]
            self.job = job or os.urandom(6).hex()
            self.token = f"resild-{self.job}-{os.urandom(4).hex()}"
            run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
            self.data = data_root or Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"resild-etcd-{run_id}"
            shutil.rmtree(self.data, ignore_errors=True)
            private_dir(self.data, "etcd data directory")  # another user's, left in /tmp: refused, not used
            layout.write_text(
                json.dumps(
                    {
                        "members": [asdict(m) for m in self.members],
                        "token": self.token,
                        "job": self.job,
                        "data": str(self.data),
                    }
                )
            )
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._restarted_s: dict[int, float] = {}

    def target(self, timeout_s: float = 1.0) -> EtcdTarget:
        return EtcdTarget(
            tuple(m.client_url for m in self.members),
            f"/resild/{self.job}",
            str(self.certs.ca),
            str(self.certs.client_cert),
            str(self.certs.client_key),
            timeout_s,
        )

    def start_member(self, i: int) -> None:
        m = self.members[i]
        private_dir(self.data, "etcd data directory")  # a resumed job's: still ours alone
        cmd = member_cmd(self.binary, m, self.members, self.data / f"{m.name}.data", self.certs, self.token)
        with open(self.dir / f"{m.name}.log", "ab") as out:
            self.procs[i] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # a terminal's ^C reaches resil-run, which stops us in order
                preexec_fn=die_with_parent,
            )

    def start(self, timeout_s: float = 30.0) -> EtcdTarget:
        for i in range(len(self.members)):
            self.start_member(i)
        target = self.target()
        self.wait_ready(target, timeout_s)
        return target

    def wait_ready(self, target: EtcdTarget, timeout_s: float) -> None:
        try:
            wait_ready(target, timeout_s, lambda: all(p.poll() is None for p in self.procs.values()))
        except RuntimeError as e:
            dead = [self.members[i].name for i, p in self.procs.items() if p.poll() is not None]
            self.stop()
            raise RuntimeError(f"{e} (exited: {', '.join(dead) or 'none'}; logs: {self.dir}/m*.log)") from None

    def restart_dead(self, now: float | None = None) -> list[str]:
        """Members that exited on their own (a crash, the OOM killer, someone's kill), started
        again on their data, each at most once per RESTART_BACKOFF_S: the job's cluster heals
        instead of one more loss costing it its majority (issue 39). A member stopped on
        purpose (`stop_member`) is not ours to restart. -> the names started again."""
        now = time.monotonic() if now is None else now
        started: list[str] = []
        for i, p in list(self.procs.items()):
            if p.poll() is None or now - self._restarted_s.get(i, -1e9) < RESTART_BACKOFF_S:
                continue
            self._restarted_s[i] = now
            say(f"resil-run: etcd member {self.members[i].name} exited (code {p.returncode}): started again")
            self.start_member(i)
            started.append(self.members[i].name)
        return started

    def stop_member(self, i: int, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        p = self.procs.pop(i, None)
        if p is not None:
            stop_group(p, sig, timeout_s)

    def stop(self) -> None:
        for i in list(self.procs):
            self.stop_member(i)

    def has_data(self) -> bool:
        return any(self.data.glob("*.data"))

    def remove_data(self) -> None:
        """The members' data, once the job is over (its journal copies stay in the run directory)."""
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


# ---- under Slurm: one member per host ----------------------------------------------
def member_file(run_dir: Path, index: int) -> Path:
    return run_dir / "etcd" / f"member-{index}.json"


def wait_for_members(run_dir: Path, n: int, timeout_s: float, alive: Callable[[], bool]) -> list[Member]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return [Member(**json.loads(member_file(run_dir, i).read_text())) for i in range(n)]
        except (OSError, ValueError, TypeError):
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(
                    f"the job's etcd members did not all start within {timeout_s:.0f}s "
                    f"(see {run_dir}/etcd/member-*.json and member-*.log)"
                ) from None
            time.sleep(0.1)


def wait_for_member_certs(keys_dir: Path, names: list[str], timeout_s: float, alive: Callable[[], bool]) -> None:
    """Until every member has signed its certificate (`member_cert_for` writes the
    certificate last), so the CA key can be forgotten."""
    base = EtcdCerts.at(keys_dir)
    deadline = time.monotonic() + timeout_s
    while not all(base.for_member(n).member_cert.exists() for n in names):
        if time.monotonic() > deadline or not alive():
            raise RuntimeError(f"the job's etcd members did not all sign their certificates within {timeout_s:.0f}s")
        time.sleep(0.1)


def slurm_target(members: list[Member], certs: EtcdCerts, job: str, timeout_s: float = 1.0) -> EtcdTarget:
    return EtcdTarget(
        tuple(m.client_url for m in members),
        f"/resild/{job}",
        str(certs.ca),
        str(certs.client_cert),
        str(certs.client_key),
        timeout_s,
    )


def wait_ready(target: EtcdTarget, timeout_s: float, alive: Callable[[], bool]) -> None:
    etcd = Etcd(target)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            etcd.get(f"{target.prefix}/ready")  # a linearizable read: a quorum answers
            return
        except EtcdError as e:
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"the job's etcd cluster did not become ready: {e}") from None
            time.sleep(0.1)


def serve_member(run_dir: Path, keys_dir: Path, hosts: list[str], index: int, timeout_s: float = 120.0) -> int:
    binary = etcd_binary()
    if binary is None:
        say(f"resild etcd member {index}: etcd is not installed on {socket.gethostname()}")
        return 1
    host = os.environ.get(resild_env.CONTROLLER_HOST.name) or socket.getfqdn()
    if host in ("127.0.0.1", "::1"):  # every member on one machine (a test): loopback only
        ip = host
    else:
        _, ip = listen_address(host, cluster=True, what="the etcd member")
    client_port, peer_port = _free_ports(ip, 2)
    me = Member(f"m{index}", host, client_port, peer_port, listen=ip)
    member_file(run_dir, index).parent.mkdir(mode=0o700, exist_ok=True)
    tmp = member_file(run_dir, index).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(me)))
    os.replace(tmp, member_file(run_dir, index))
    members = wait_for_members(run_dir, len(hosts), timeout_s, lambda: True)
    certs = member_cert_for(keys_dir, me.name, {host, ip, socket.gethostname()} - {"0.0.0.0"})
    # The member's data on the host's own disk (etcd fsyncs every commit: not a shared file
    # system), named for this run directory and started afresh (a requeued job is a new run).
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"resild-etcd-{run_id}-{me.name}"
    shutil.rmtree(root, ignore_errors=True)
    try:
        data = private_dir(root, "etcd data directory") / "data"
    except NotOwnError as e:
        say(f"resild etcd member {index}: {e}")
        return 1
    token = f"resild-{run_id}-{os.environ.get('SLURM_JOB_ID', '')}"
    cmd = member_cmd(binary, me, members, data, certs, token)
    log = open(run_dir / "etcd" / f"member-{index}.log", "ab")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.execv(binary, cmd)  # srun's task is etcd itself: it ends with the step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resild.controller.etcd_cluster", description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--keys", type=Path, required=True, help="the job's keys directory (its etcd CA)")
    p.add_argument("--hosts", required=True, help="the members' hosts, comma-separated (Slurm node names)")
    p.add_argument("--index", type=int, help="default: $SLURMD_NODENAME's place in --hosts")
    a = p.parse_args(argv)
    hosts = [h for h in a.hosts.split(",") if h]
    index = a.index
    if index is None:
        node = os.environ.get("SLURMD_NODENAME", "")
        index = hosts.index(node) if node in hosts else None
    if index is None or not 0 <= index < len(hosts):
        p.error(f"--index {index} is not one of --hosts {a.hosts}")
    die_with_parent()
    return serve_member(a.run_dir, a.keys, hosts, index)


if __name__ == "__main__":
    sys.exit(main())
