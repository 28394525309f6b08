"""resil-run's flag handling that needs no job (the rest: the job tests beside this file)."""

from __future__ import annotations

import click
import pytest

from launcher.run.cli import _site_etcd


def test_a_plain_http_site_etcd_is_warned_about_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The journal says who leads and what was committed (issue 39, finding 14)."""
    target = _site_etcd("http://10.0.0.5:2379,https://10.0.0.6:2379", None, None, None, "/site/a")
    assert target is not None and len(target.endpoints) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("resild: warning: --etcd http://10.0.0.5:2379 is plain HTTP"), err
    _site_etcd("https://10.0.0.6:2379", None, None, None, "/site/a")
    assert capsys.readouterr().err == ""


def test_bad_site_etcd_flags_are_usage_errors() -> None:
    with pytest.raises(click.UsageError, match="--etcd-cert and --etcd-key go together"):
        _site_etcd("https://h:1", None, "/c.pem", None, None)
    with pytest.raises(click.UsageError, match="need --etcd"):
        _site_etcd(None, "/ca.pem", None, None, None)
    with pytest.raises(click.UsageError, match="--etcd: "):
        _site_etcd("ftp://h:1", None, None, None, None)


@pytest.mark.timeout(60)
def test_consensus_raft_is_gone_and_said_so_in_one_line() -> None:
    """One consensus engine, the one held to the security standard (issue 39, finding 16)."""
    import subprocess

    from bench.commands import resil_run

    r = subprocess.run(
        resil_run("--controllers", "3", "--consensus", "raft", worker=["true"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(err) == 1 and "--consensus raft was removed" in err[0], r.stderr
