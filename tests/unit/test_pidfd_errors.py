"""A pidfd the server cannot open for want of descriptors is not a host
without pidfds. pidfd_open took any OSError (EMFILE, ENFILE, ENOMEM) for "this
kernel has none" and answered -1: the registration or copy that asked was then
checked by the pid alone, which another process may have taken over. Now only
what means "no pidfds here" (ENOSYS, ENODEV, a seccomp EPERM) gives -1; out of
descriptors refuses that one check (Overloaded, naming the field and pid), and
an unforeseen error refuses it too."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pegaflow.common import pidfds
from pegaflow.common.errors import InvalidRequest, Overloaded, PermissionDenied
from pegaflow.server import socket_peer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("code", "answer"),
    [
        (errno.ENOSYS, -1),
        (errno.ENODEV, -1),
        (errno.EPERM, -1),
        (errno.EMFILE, Overloaded),
        (errno.ENFILE, Overloaded),
        (errno.ENOMEM, Overloaded),
        (errno.EINVAL, InvalidRequest),
        (errno.EIO, PermissionDenied),
    ],
)
def test_only_a_host_without_pidfds_checks_by_pid_alone(
    monkeypatch, code: int, answer: object
) -> None:
    def fails(pid: int, flags: int = 0) -> int:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pidfd_open", fails)
    if answer == -1:
        assert pidfds.pidfd_open(os.getpid(), "layer_signals.pid") == -1
        return
    with pytest.raises(answer) as err:
        pidfds.pidfd_open(os.getpid(), "layer_signals.pid")
    assert str(err.value).startswith("layer_signals.pid: "), err.value
    assert str(os.getpid()) in str(err.value)


# Run with the soft RLIMIT_NOFILE at the lowest free descriptor (+ spare):
# the next open fails with EMFILE, as in a server holding as many
# connections as it may open descriptors.
SCENARIO = textwrap.dedent(
    r"""
    import os, resource, sys
    from pegaflow.common.pidfds import PidsHeld, ProcessImage, pidfd_open

    def lowest_free():
        fd = os.dup(0)
        os.close(fd)
        return fd

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    pid, free = os.getpid(), lowest_free()

    def at_most(spare, what, work):
        resource.setrlimit(resource.RLIMIT_NOFILE, (free + spare, hard))
        try:
            got = work()
        except Exception as exc:
            got = exc
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        leaked = lowest_free() != free
        print(what, type(got).__name__, "leaked" if leaked else "", got, flush=True)

    at_most(0, "pidfd_open", lambda: pidfd_open(pid, "pid"))
    at_most(1, "image", lambda: ProcessImage(pid, "layer_signals.pid"))
    # The first image takes three (pidfd, /proc/<pid>, its mem), reading its
    # status a fourth: the second image finds none.
    at_most(4, "held", lambda: PidsHeld([(pid, "pid"), (pid, "layer_signals.pid")]))
    """
)


def test_out_of_descriptors_refuses_the_check_and_leaks_none() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", SCENARIO],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"pidfd_open", "image", "held"}, out.stdout
    for what, field in (
        ("pidfd_open", "pid"),
        ("image", "layer_signals.pid"),
        ("held", "layer_signals.pid"),
    ):
        got = lines[what]
        assert got.startswith("Overloaded  "), (what, got)  # not leaked
        assert f"{field}: the server cannot open a descriptor" in got, (what, got)
        assert "Too many open files" in got, (what, got)


class _Refusing:
    """A connection whose SO_PEERPIDFD the kernel answers with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code

    def getsockopt(self, *args: int) -> int:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.skipif(socket_peer.SO_PEERPIDFD is None, reason="no SO_PEERPIDFD")
def test_the_connecting_process_unknown_for_want_of_memory_is_not_a_pass() -> None:
    """SO_PEERPIDFD's ENOMEM, or an error not foreseen, read as "still runs":
    the registration went on unchecked. Now only a kernel without it does."""
    assert socket_peer.peer_exited(_Refusing(errno.ENOPROTOOPT)) is False
    assert socket_peer.peer_exited(_Refusing(errno.ESRCH)) is True
    for code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        with pytest.raises(Overloaded, match="register: the server cannot take"):
            socket_peer.peer_exited(_Refusing(code))
    with pytest.raises(PermissionDenied, match="register: the kernel did not tell"):
        socket_peer.peer_exited(_Refusing(errno.EIO))
