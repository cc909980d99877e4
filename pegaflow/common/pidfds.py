"""pidfds: handles that name a process itself, not its number. The copies
(process_vm_readv/writev) and /proc can only name an engine by its pid, which
the kernel hands on to a new process once the engine exits; a pidfd held from
before the server checks a process until it is done with it tells whether the
pid still means that process.

A pid (and its pidfd) also outlives an execve: the process then runs another
program, in a new address space, perhaps with a setuid program's rights.
ProcessImage holds, beside the pidfd, what tells that apart (see there), and
every copy checks it first (issue 30 #1).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading

from .errors import CopyFailed, InvalidRequest, Overloaded, PermissionDenied
from .thread_creds import EngineIds

logger = logging.getLogger(__name__)

# What pidfd_open answers where there is no pidfd to be had here: a kernel
# before 5.3 (ENOSYS), one without anonymous inodes (ENODEV), or a seccomp
# profile that denies the call (older Docker answers an unknown system call
# with EPERM). Each holds for good on this host, so the pid alone is all a
# check can go by (docs/security.md).
_NO_PIDFDS = (errno.ENOSYS, errno.ENODEV, errno.EPERM)
# Out of descriptors or memory for now: a pidfd exists, the server cannot hold
# one this moment. The check is refused then, never done without it.
NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)


def no_descriptor(field: str, pid: int, exc: OSError) -> Overloaded:
    """The error a check that could not open a descriptor for `pid` answers."""
    logger.warning("%s: cannot open a descriptor for process %d: %s", field, pid, exc)
    return Overloaded(
        f"{field}: the server cannot open a descriptor for process {pid} now "
        f"({exc.strerror}); retry later"
    )


class ProcessChanged(PermissionDenied):
    """The process executed another program or changed credentials since it
    was checked: its memory and rights are no longer the ones vouched for."""


def pidfd_open(pid: int, field: str = "pid") -> int:
    """A pidfd for `pid`, or -1 where this host has none (_NO_PIDFDS: the bare
    pid is all there is). Open it before checking the process, and see it still
    live after: then the checks were of the process it names. Overloaded when
    out of descriptors (NO_DESCRIPTOR): a check without the pidfd it could
    have is weaker, so it is refused instead."""
    if not 0 < pid < 1 << 31:  # not a pid_t: the callers' checks name it
        return -1
    if not hasattr(os, "pidfd_open"):  # not Linux
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise InvalidRequest(f"{field}: process {pid} does not exist") from None
    except OSError as exc:
        if exc.errno in _NO_PIDFDS:
            return -1
        if exc.errno in NO_DESCRIPTOR:
            raise no_descriptor(field, pid, exc) from None
        if exc.errno in (errno.EINVAL, errno.ENOENT):  # flags are 0: a thread's id
            raise InvalidRequest(
                f"{field}: {pid} is not a process (a thread's id?)"
            ) from None
        raise PermissionDenied(  # unforeseen: refused, not checked by pid alone
            f"{field}: the server cannot hold process {pid} by a pidfd ({exc.strerror})"
        ) from None


# An address above every user address space (57-bit paging's included): no
# process maps it, so reading it there fails at once, before any page could
# fault. Reading a page the engine maps instead could wait on the engine for
# as long as it likes (a FUSE file mapped there, a userfaultfd registered on
# it): tests/server/test_stalled_engine.py. An offset of /proc/<pid>/mem and
# a process_vm_readv address alike.
NOWHERE = 1 << 62


class ProcessImage:
    """One process as the program it runs and the rights it holds, from when
    this was opened (before the process is checked) until close().

    - The pidfd: the process itself, not a successor that took over its pid.
    - /proc/<pid>/mem, opened now: bound to the address space the process has
      now. An execve gives the process a new one and the old one dies; a read
      of this descriptor then returns nothing (EOF), while the live one answers
      EIO at NOWHERE, an address no process maps.
    - /proc/<pid> (a directory descriptor, bound to the pid like the pidfd):
      its files' owner is the process's effective uid and gid while it is
      dumpable, root once it is not (looked up afresh: an open file's owner
      is not updated). A setuid or setgid program, an unreadable one, or
      PR_SET_DUMPABLE 0 changes it, even in the corner where the old address
      space lives on (shared with a clone(CLONE_VM) child, so the read above
      still answers).
    - capget(pid): capabilities gained (a file-capability program).
    - `ids`: its real uid and gid, which the copies act as (thread_creds):
      the kernel's check in each copy then refuses a program exec'd after
      check() with rights that user lacks.

    check() costs four system calls, ~9.7 us of CPU on the 2-core dev VM (the
    pidfd alone: 1.3 us): once before each copy batch, never per block.
    """

    def __init__(self, pid: int, field: str = "pid") -> None:
        self.pid = pid
        self.pidfd = pidfd_open(pid, field)  # first: what the others must match
        self._dir = self._mem = -1
        try:
            self._dir = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY)
            try:
                self._mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
            except (PermissionError, ProcessLookupError):
                # No ptrace access (yet), or a zombie (no memory): the checks
                # that follow refuse it with their own message (or access is
                # granted meanwhile: then `complete` refuses it).
                self._mem = -1
            st = os.stat("status", dir_fd=self._dir)
            self._uid, self._gid = st.st_uid, st.st_gid
            self.ids = EngineIds.from_status(
                _read(self._dir, "status"), _userns(self._dir)
            )
            self._eff, self._prm = _capget(pid)
        except (FileNotFoundError, ProcessLookupError):
            self.close()
            raise InvalidRequest(f"{field}: process {pid} does not exist") from None
        except OSError as exc:
            self.close()
            if exc.errno in NO_DESCRIPTOR:  # as for the pidfd: a clear refusal
                raise no_descriptor(field, pid, exc) from None
            raise
        except BaseException:
            self.close()
            raise

    @property
    def complete(self) -> bool:
        """Whether an exec can be seen (its memory could be opened)."""
        return self._mem >= 0

    def check(self, what: str, rights: bool = True) -> None:
        """CopyFailed if the process is gone; ProcessChanged if it runs
        another program or holds other rights than when this was opened.
        rights=False: the program only (two system calls, not four), where
        the rights were checked moments before (see LayerSignals.signal)."""
        if exited(self.pidfd):
            raise CopyFailed(f"{what}: engine process {self.pid} is gone")
        why = self.changed(rights)
        if why == _EXITING:
            raise CopyFailed(f"{what}: engine process {self.pid} is gone")
        if why:
            raise ProcessChanged(
                f"{what}: process {self.pid} {why} since it registered: the memory "
                "and rights checked then are gone, so its registration has "
                "ended; a new program registers its own memory"
            )

    def changed(self, rights: bool = True) -> str:
        """ "" while the process runs the program, with the rights, it had when
        this was opened; else what changed (_EXITING: it is exiting)."""
        if self._mem >= 0 and not _address_space_lives(self._mem):
            return self._exec_or_exit()
        if not rights:
            return ""
        try:
            st = os.stat("status", dir_fd=self._dir)
        except (FileNotFoundError, ProcessLookupError):  # reaped
            return _EXITING
        if st.st_uid != self._uid or st.st_gid != self._gid:
            return (
                "executed a new program or changed credentials (its /proc "
                f"entry's owner went from uid {self._uid} gid {self._gid} to uid "
                f"{st.st_uid} gid {st.st_gid}: setuid, setgid or no longer dumpable)"
            )
        try:
            eff, prm = _capget(self.pid)
        except ProcessLookupError:
            return _EXITING
        gained = (eff & ~self._eff) | (prm & ~self._prm)  # dropping some: no risk
        if gained:
            return f"executed a new program that gained capabilities ({gained:#x})"
        return ""

    def _exec_or_exit(self) -> str:
        """Its address space is gone: a new program has one (and an exe),
        an exiting process none."""
        try:
            exe = os.readlink("exe", dir_fd=self._dir)
        except OSError:
            return _EXITING
        return f"executed a new program ({exe})"

    def close(self) -> None:
        for fd in (self.pidfd, self._dir, self._mem):
            if fd >= 0:
                os.close(fd)
        self.pidfd = self._dir = self._mem = -1


_EXITING = "exiting"


def _userns(dir_fd: int) -> int:
    """The inode of the process's user namespace; 0 where it may not be
    looked at (no ptrace read access: a server without rights over it,
    which then copies only as its own user anyway) or is gone (a zombie)."""
    try:
        return os.stat("ns/user", dir_fd=dir_fd).st_ino
    except OSError:
        return 0


def _read(dir_fd: int, name: str) -> str:
    """A small /proc file (under 4 KiB, read at once) of the process."""
    fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    finally:
        os.close(fd)


def _address_space_lives(mem: int) -> bool:
    """Whether the address space a /proc/<pid>/mem descriptor was opened on
    still has a user: EIO at NOWHERE if so (no page there to read), EOF once
    it died. Another error (ENOMEM) tells neither: no copy then."""
    try:
        return bool(os.pread(mem, 1, NOWHERE))
    except OSError as exc:
        if exc.errno == errno.EIO:
            return True
        raise CopyFailed(f"cannot tell whether the engine exec'd: {exc}") from None


_CAPGET = ctypes.CDLL(None, use_errno=True)["capget"]
_CAPGET.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
_CAP_V3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words each
_CAP_BUFS = threading.local()  # checks run on the loop and on copy threads


def _capget(pid: int) -> tuple[int, int]:
    """(effective, permitted) capabilities of pid, 64 bits each. The buffer:
    struct __user_cap_header_struct {u32 version; int pid;} then two of
    struct __user_cap_data_struct {u32 effective, permitted, inheritable;}."""
    buf = getattr(_CAP_BUFS, "buf", None)
    if buf is None:
        buf = _CAP_BUFS.buf = (ctypes.c_uint32 * 8)()
    buf[0], buf[1] = _CAP_V3, pid
    addr = ctypes.addressof(buf)
    if _CAPGET(addr, addr + 8) != 0:
        err = ctypes.get_errno()
        if err == errno.ESRCH:
            raise ProcessLookupError(err, f"capget: no process {pid}")
        raise OSError(err, f"capget({pid}): {os.strerror(err)}")
    return buf[2] | buf[5] << 32, buf[3] | buf[6] << 32


class PidsHeld:
    """The processes a registration names (ProcessImage each), open from
    before its checks until after them: `check()` then says every check was of
    the process now registered, running the program it ran when checked, not
    of one that took over a pid, or of a program exec'd, in between."""

    def __init__(self, pids: list[tuple[int, str]]) -> None:
        self._held: list[tuple[ProcessImage | None, int, str]] = []
        try:
            for pid, field in pids:
                try:
                    image: ProcessImage | None = ProcessImage(pid, field)
                except InvalidRequest:  # no such process: the checks say so
                    image = None
                self._held.append((image, pid, field))
        except BaseException:  # out of descriptors: those opened go back
            self.close()
            raise

    def check(self) -> None:
        for image, pid, field in self._held:
            if image is None or exited(image.pidfd):
                raise InvalidRequest(f"{field}: process {pid} exited while registering")
            if not image.complete:
                raise InvalidRequest(
                    f"{field}: the server could not open process {pid}'s memory "
                    "when the registration began (ptrace access granted only "
                    "meanwhile?); register again"
                )
            why = image.changed()
            if why == _EXITING:
                raise InvalidRequest(f"{field}: process {pid} exited while registering")
            if why:
                raise ProcessChanged(f"{field}: process {pid} {why} while registering")

    def close(self) -> None:
        for image, _, _ in self._held:
            if image is not None:
                image.close()
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
