from __future__ import annotations

import os
from pathlib import Path

import pytest

from resild.wire.own_dir import NotOwnError, check_own_file, private_dir


def test_a_missing_directory_is_made_private(tmp_path: Path) -> None:
    d = private_dir(tmp_path / "a" / "b")
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700


def test_an_existing_private_directory_of_ours_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    assert private_dir(tmp_path / "d") == tmp_path / "d"


@pytest.mark.parametrize("mode,word", [(0o777, "writable"), (0o755, "readable"), (0o770, "writable")])
def test_a_directory_others_may_use_is_refused_in_one_line(tmp_path: Path, mode: int, word: str) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, mode)
    with pytest.raises(NotOwnError, match=f"is {word} by other users") as e:
        private_dir(d, "etcd data directory")
    assert "\n" not in str(e.value) and "etcd data directory" in str(e.value)


def test_others_may_read_where_asked_but_never_write(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o755)
    assert private_dir(d, others_may_read=True) == d
    os.chmod(d, 0o775)
    with pytest.raises(NotOwnError, match="writable"):
        private_dir(d, others_may_read=True)


def test_a_link_or_a_file_in_its_place_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(NotOwnError, match="not a directory"):
        private_dir(tmp_path / "link")
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotOwnError, match="not a directory"):
        private_dir(tmp_path / "f")


def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    d = tmp_path / "squat"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(NotOwnError, match="belongs to uid 65534"):
        private_dir(d)


def test_an_own_file_others_may_write_is_refused(tmp_path: Path) -> None:
    f = tmp_path / ".metadata"
    f.write_bytes(b"x")
    os.chmod(f, 0o644)
    check_own_file(f)
    os.chmod(f, 0o666)
    with pytest.raises(NotOwnError, match="writable by other users"):
        check_own_file(f, "checkpoint metadata")
