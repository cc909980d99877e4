"""pidfds: handles that name a process itself, not its number. The copies
(process_vm_readv/writev) and /proc can only name an engine by its pid, which
the kernel hands on to a new process once the engine exits; a pidfd held from
before the server checks a process until it is done with it tells whether the
pid still means that process."""

from __future__ import annotations

import os
import select

from .errors import InvalidRequest


def pidfd_open(pid: int, field: str = "pid") -> int:
    """A pidfd for `pid`, or -1 where the kernel has none (< 5.3: the bare pid
    is all there is). Open it before checking the process, and see it still
    live after: then the checks were of the process it names."""
    if not 0 < pid < 1 << 31:  # not a pid_t: the callers' checks name it
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise InvalidRequest(f"{field}: process {pid} does not exist") from None
    except (OSError, AttributeError):
        return -1


class PidsHeld:
    """pidfds of the processes a registration names, open from before its
    checks until after them: `check()` then says every check was of the process
    now registered, not of one that took over a pid in between."""

    GONE = -2  # no such process when opened: the checks' own errors say so

    def __init__(self, pids: list[tuple[int, str]]) -> None:
        self._held: list[tuple[int, int, str]] = []
        for pid, field in pids:
            try:
                fd = pidfd_open(pid, field)
            except InvalidRequest:
                fd = self.GONE
            self._held.append((fd, pid, field))

    def check(self) -> None:
        for fd, pid, field in self._held:
            if fd == self.GONE or exited(fd):
                raise InvalidRequest(f"{field}: process {pid} exited while registering")

    def close(self) -> None:
        for fd, _, _ in self._held:
            if fd >= 0:
                os.close(fd)
        self._held = []

    def __enter__(self) -> PidsHeld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exited(pidfd: int) -> bool:
    """A pidfd polls readable once its process has exited. poll(), not
    select(): select() refuses any descriptor from 1024 on, and a server
    holding that many (its clients' connections) would refuse every check."""
    if pidfd < 0:
        return False
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))
