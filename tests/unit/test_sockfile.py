"""pegaflow.server.socket_file: the fast-path socket file is private from its creation,
never replaces what it did not make, and is removed only while it is ours."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from pegaflow.daemon.startup import StartupError
from pegaflow.server import socket_file as sockfile
from pegaflow.server.socket_file import bind_private_unix, unlink_if_ours


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_socket_is_0600_at_bind(tmp_path: Path, monkeypatch) -> None:
    """Scenario: the old code bound with the umask's mode and chmodded after,
    so for a moment anyone could connect. The mode is read inside bind() itself,
    before bind_private_unix could change anything afterwards."""
    seen: list[int] = []

    class Recording(socket.socket):
        def bind(self, address: str) -> None:
            super().bind(address)
            seen.append(_mode(Path(address)))

    monkeypatch.setattr(sockfile.socket, "socket", Recording)
    os.umask(old := os.umask(0o022))  # a typical umask: 0755 sockets
    path = tmp_path / "q.sock"
    sock = bind_private_unix(str(path))
    try:
        assert seen == [0o600] and _mode(path) == 0o600
        assert os.umask(old) == old  # restored
    finally:
        sock.close()


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
def test_refuses_what_is_not_a_socket(tmp_path: Path, kind: str) -> None:
    """Scenario: --query-socket names an existing file (a typo, or a symlink to
    one); the old code deleted it. It must be refused and left as it was."""
    path, target = tmp_path / "q.sock", tmp_path / "precious"
    target.write_bytes(b"keep me")
    if kind == "file":
        path.write_bytes(b"keep me")
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to(target)
    with pytest.raises(StartupError, match="--socket.*not a socket"):
        bind_private_unix(str(path))
    assert os.path.lexists(path) and target.read_bytes() == b"keep me"
    if kind == "file":
        assert path.read_bytes() == b"keep me"


def test_missing_directory_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="--socket: directory .* not exist"):
        bind_private_unix(str(tmp_path / "no" / "such" / "q.sock"))


def test_stale_socket_of_ours_is_replaced(tmp_path: Path, caplog) -> None:
    """Scenario: a server died without removing its socket; a new one reuses the
    path (connect() is refused: nobody listens)."""
    path = tmp_path / "q.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()
    with caplog.at_level("INFO", logger="pegaflow.server.socket_file"):
        sock = bind_private_unix(str(path))
    try:
        assert "stale" in caplog.text
        assert _mode(path) == 0o600
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(path))  # the new socket listens
        probe.close()
    finally:
        sock.close()


def test_live_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "q.sock"
    live = bind_private_unix(str(path))
    try:
        with pytest.raises(StartupError, match="another server is listening"):
            bind_private_unix(str(path))
        assert unlink_if_ours(str(path), live) and not path.exists()
    finally:
        live.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_socket_of_another_uid_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "q.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path))
    other.close()
    os.chown(path, 4242, 4242, follow_symlinks=False)
    with pytest.raises(StartupError, match="uid 4242"):
        bind_private_unix(str(path))
    assert os.path.lexists(path)


def test_unlink_leaves_a_replaced_file(tmp_path: Path) -> None:
    """Scenario: at stop the path no longer is our inode (someone moved ours
    away and put their own file there): it is not ours to delete."""
    path = tmp_path / "q.sock"
    sock = bind_private_unix(str(path))
    try:
        os.rename(path, tmp_path / "moved.sock")
        path.write_bytes(b"theirs")
        assert not unlink_if_ours(str(path), sock)
        assert path.read_bytes() == b"theirs"
    finally:
        sock.close()
