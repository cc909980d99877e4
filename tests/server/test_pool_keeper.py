"""The kept pool as a sealed memfd held by a keeper process (issue 30 #11),
through real servers and keepers: nobody can cut the pool short under a running
server (a truncated pool file was a SIGBUS), the pool survives the keeper's
SIGKILL as well as the server's, `rm PATH` frees it, and another user can
neither squat the path nor take the pool."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.keeper_tools import keeper_pid, memfd_path, wait_gone
from tests.kvbuf import LocalKV
from tests.procs import ROOT, _env
from tests.server.test_pool_file import SHM, N, _failed_start, _flags, _hits, _save

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run a process as uid 65534"
)


@pytest.fixture
def tmp_path(tmp_path: Path) -> Iterator[Path]:
    """In /dev/shm, as docs/operations.md suggests; 1777 like /dev/shm itself,
    so that another user may create a name in it."""
    if not SHM.is_dir():
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="pegaflow-test-", dir=SHM) as d:
        os.chmod(d, 0o1777)
        yield Path(d)


def _as_nobody(code: str, *args: str) -> subprocess.Popen:
    """Python run as uid 65534 (dropped after start-up: the interpreter lives
    under /root here), its stdin and stdout pipes."""
    prelude = "import os, socket, sys, time\nos.setgroups([]); os.setgid(65534); "
    prelude += "os.setuid(65534)\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
        cwd=ROOT,
        text=True,
    )


def test_the_pool_cannot_be_cut_short_under_a_running_server(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: 64 blocks saved; the pool's owner (here root) tries to shrink
    it: `truncate` of the path, then of the pool's descriptor in the keeper
    and in the server (/proc/PID/fd/N: truncate(2) and ftruncate(2)), and to
    grow it. Every attempt fails; the server saves and loads 64 more blocks
    and serves all 128 byte-equal. Before, `truncate -s 16K` of the pool
    file, then a save, killed the server with SIGBUS."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=21))
    path = tmp_path / "pool.bin"
    with pytest.raises(OSError) as err:
        os.truncate(path, 16 << 10)
    assert err.value.errno == errno.EINVAL  # a socket, no file
    for pid in (keeper_pid(path), server.pid):
        link = memfd_path(pid)
        with pytest.raises(PermissionError):
            os.truncate(link, 16 << 10)
        fd = os.open(link, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for bad in (16 << 10, 0, size * 2):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, bad)
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)
    hs2, want2 = _save(server, LocalKV(seed=22))
    assert _hits(server, hs2, want2) == N
    assert _hits(server, hs, want) == N
    assert server.proc.poll() is None


def _new_keeper(path: Path, old: int) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            pid = keeper_pid(path)
            if pid != old:
                return pid
        except ConnectionRefusedError:  # the dead keeper's socket, still
            pass
        assert time.monotonic() < deadline, "no new keeper after 60 s"
        time.sleep(0.05)


def test_a_killed_keeper_is_reseeded_and_the_pool_outlives_the_server(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: 64 blocks saved; the keeper is SIGKILLed while the server
    runs. The server starts a new keeper with the pool it maps; then the
    server is SIGKILLed too, and a new one on the path hits all 64."""
    server = server_factory(*_flags(tmp_path))
    hs, want = _save(server, LocalKV(seed=23))
    path = tmp_path / "pool.bin"
    old = keeper_pid(path)
    os.kill(old, signal.SIGKILL)
    wait_gone(old)
    new = _new_keeper(path, old)
    said = f"pool keeper {old} died; keeper {new} holds the pool now"
    deadline = time.monotonic() + 60  # logged once it claimed the pool back
    while said not in server.log.read_text():
        assert time.monotonic() < deadline, f"not logged: {said}"
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    server = server_factory(*_flags(tmp_path))
    assert _hits(server, hs, want) == N


def _holders(ino: tuple[int, int]) -> list[str]:
    """Every descriptor or mapping of that inode on this host (as root: all
    processes; otherwise this user's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                st = os.stat(f"/proc/{pid}/fd/{name}")
                if (st.st_dev, st.st_ino) == ino:
                    found.append(f"pid {pid} fd {name}")
            with open(f"/proc/{pid}/maps") as maps:
                if any(f" {ino[1]} " in line and "memfd:" in line for line in maps):
                    found.append(f"pid {pid} maps it")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def test_rm_path_stops_the_keeper_and_frees_the_pool(
    server_factory, tmp_path: Path
) -> None:
    """Scenario: a server saved 64 blocks and stopped; `rm PATH`: the keeper
    exits and no process holds or maps the pool's memfd any more (the kernel
    frees its memory), as removing the pool file did."""
    server = server_factory(*_flags(tmp_path))
    _save(server, LocalKV(seed=24))
    server.stop(signal.SIGTERM)
    path = tmp_path / "pool.bin"
    pid = keeper_pid(path)
    st = os.stat(memfd_path(pid))
    ino = (st.st_dev, st.st_ino)
    assert _holders(ino)
    path.unlink()
    wait_gone(pid)
    assert _holders(ino) == []


@needs_root
def test_another_users_socket_at_the_path_is_refused(tmp_path: Path) -> None:
    """Scenario: user nobody binds a socket at the path first (a shared
    directory such as /dev/shm). The server refuses to start, naming the
    path, the owner and the fix, and leaves the socket alone."""
    path = tmp_path / "pool.bin"
    squat = _as_nobody(
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.bind(sys.argv[1]); s.listen(); print('bound', flush=True)\n"
        "time.sleep(120)\n",
        str(path),
    )
    try:
        assert squat.stdout.readline().strip() == "bound"
        rc, err = _failed_start(*_flags(tmp_path))
    finally:
        squat.kill()
        squat.wait()
    line = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err, err
    assert str(path) in line and f"uid {NOBODY}" in line and "remove it" in line
    assert path.is_socket() and path.lstat().st_uid == NOBODY


@needs_root
def test_another_user_cannot_take_the_pool(server_factory, tmp_path: Path) -> None:
    """Scenario: user nobody tries to get the pool: connect to the keeper's
    socket (0600: refused), open its memfd through /proc (refused); and with
    the socket made world-writable by mistake, the keeper itself refuses the
    uid (SO_PEERCRED) and hands over no descriptor."""
    server = server_factory(*_flags(tmp_path))
    path = tmp_path / "pool.bin"
    server.stop(signal.SIGTERM)  # the pool is free to claim: the worst case
    link = memfd_path(keeper_pid(path))
    code = (
        "def connect():\n"
        "    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "    try:\n"
        "        s.connect(sys.argv[1])\n"
        "    except PermissionError:\n"
        "        return 'refused'\n"
        "    msg, fds, _, _ = socket.recv_fds(s, 64, 1)\n"
        "    return f'{msg.decode()} fds={len(fds)}'\n"
        "try:\n"
        "    os.open(sys.argv[2], os.O_RDONLY); fd = 'opened'\n"
        "except PermissionError:\n"
        "    fd = 'refused'\n"
        "print(connect(), fd, flush=True)\n"
        "sys.stdin.readline()  # the test chmods the socket meanwhile\n"
        "print(connect(), flush=True)\n"
    )
    thief = _as_nobody(code, str(path), link)
    try:
        assert thief.stdout.readline().split() == ["refused", "refused"]
        path.chmod(0o666)
        thief.stdin.write("again\n")
        thief.stdin.flush()
        assert thief.stdout.readline().strip() == f"UID {NOBODY} fds=0"
    finally:
        thief.kill()
        thief.wait()
