"""Paths resild trusts are the job user's own (issue 39, findings 6 and 7): an etcd data
directory or a checkpoint directory planted by someone else, or open to others, is refused
in one line; never used as found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resild.controller.etcd_cluster import LocalEtcd
from resild.wire.keys import generate_keys
from resild.wire.own_dir import NotOwnError
from tests.etcdlab.fixture import ensure_etcd

pytestmark = pytest.mark.timeout(60)


def test_an_etcd_data_directory_planted_as_a_link_is_refused(tmp_path: Path) -> None:
    ensure_etcd()
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    planted = tmp_path / "resild-etcd-x"
    planted.symlink_to(elsewhere)  # rmtree will not remove a link: it must not be followed either
    keys = generate_keys(tmp_path / "keys")
    with pytest.raises(NotOwnError, match="not a directory"):
        LocalEtcd(tmp_path / "run", keys.path, 3, fresh=True, data_root=planted)
    assert not any(elsewhere.iterdir())


def test_an_etcd_data_directory_others_may_write_is_refused_on_resume(tmp_path: Path) -> None:
    ensure_etcd()
    keys = generate_keys(tmp_path / "keys")
    data = tmp_path / "resild-etcd-y"
    cluster = LocalEtcd(tmp_path / "run", keys.path, 3, fresh=True, data_root=data)
    assert (data.stat().st_mode & 0o777) == 0o700
    os.chmod(data, 0o777)  # someone made it everyone's between two runs
    with pytest.raises(NotOwnError, match="writable by other users"):
        cluster.start_member(0)
    assert not cluster.procs


def test_a_checkpoint_dir_others_may_write_is_refused_in_one_line(tmp_path: Path) -> None:
    import subprocess

    from bench.commands import resil_run

    planted = tmp_path / "ckpt"
    planted.mkdir()
    os.chmod(planted, 0o777)  # anyone could plant a step directory with a .metadata pickle there
    r = subprocess.run(
        resil_run("--checkpoint-dir", str(planted), worker=["true"]), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert err == [f"Error: {planted}: the --checkpoint-dir is writable by other users (mode 0777): chmod go-rwx it"]
