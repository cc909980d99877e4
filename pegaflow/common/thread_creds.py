"""Copy into an engine with the engine's own credentials, so that the kernel
vouches for every process_vm_readv/writev (issue 30 #1).

Those calls find the target's memory and check ptrace access in one step,
under the lock an execve takes (exec_update_lock): a check of ours before the
call can be outdone by an exec that lands between the two, the kernel's own
cannot. Its test (kernel/ptrace.c __ptrace_may_access, PTRACE_MODE_ATTACH_
REALCREDS) allows the call when

- the caller's real uid equals the target's real, effective and saved uid,
  and the caller's real gid the target's real, effective and saved gid (the
  caller's effective, fs and supplementary ids are not compared), and the
  target's memory is dumpable (a setuid, setgid or file-capability exec, or
  PR_SET_DUMPABLE 0, makes it not), then the LSMs agree (commoncap: the
  target's permitted capabilities within the caller's permitted; Yama);
- or the caller has CAP_SYS_PTRACE in the target's user namespace: in its
  effective set, or as that namespace's owner (by effective uid) - and that
  passes whatever program the target runs.

A root server passes by the second rule. So each call runs on a thread (Linux
credentials are per thread: glibc's setresuid and os.setresuid change every
thread, the raw system calls only the caller) whose real and effective ids
are the engine's and whose effective capability set is empty; the permitted
set and the saved uid stay, so the thread can take its own back after.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
import threading
from dataclasses import dataclass
from typing import Literal

from .errors import CopyFailed

logger = logging.getLogger(__name__)

# (setresuid, setresgid, capget, capset) by machine: the raw calls.
_SYSCALLS = {
    "x86_64": (117, 119, 125, 126),
    "aarch64": (147, 149, 90, 91),
}
_CAP_SETGID, _CAP_SETUID, _CAP_SYS_PTRACE = 6, 7, 19
_CAP_V3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words each
_PR_GET_DUMPABLE, _PR_SET_DUMPABLE, _PR_GET_SECUREBITS = 3, 4, 27
_SECBIT_NO_SETUID_FIXUP = 1 << 2
_KEEP = -1  # setres[ug]id: leave this id as it is

Mode = Literal["none", "drop", "switch", "unvouched"]


@dataclass(frozen=True, slots=True)
class EngineIds:
    """An engine process's real uid and gid, as it registered, and its user
    namespace (the inode of /proc/<pid>/ns/user; 0: unknown, taken as ours)."""

    uid: int
    gid: int
    userns: int = 0

    @classmethod
    def from_status(cls, text: str, userns: int = 0) -> EngineIds:
        """From /proc/<pid>/status: the first (real) field of Uid: and Gid:."""
        ids = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("Uid", "Gid"):
                ids[key] = int(rest.split()[0])
        return cls(ids["Uid"], ids["Gid"], userns)


@dataclass(frozen=True, slots=True)
class _Home:
    """The server's own credentials (every thread's outside a copy)."""

    ruid: int
    euid: int
    suid: int
    rgid: int
    egid: int
    sgid: int
    caps: tuple[int, int, int]  # effective, permitted, inheritable
    dumpable: bool
    fixup: bool  # euid 0 -> other clears the effective set (no SECBIT_NO_SETUID_FIXUP)
    yama: int  # kernel.yama.ptrace_scope; 0 without Yama
    userns: int  # our user namespace's inode


class _Sys:
    """The raw calls, bound once. Arguments go as C ints (libffi widens them
    to the registers' 64 bits, sign included, and the kernel reads a uid_t's
    32), pointers as c_void_p."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fn = libc["syscall"]
        self.fn.restype = ctypes.c_long
        self.prctl = libc["prctl"]
        self.prctl.restype = ctypes.c_int
        self.nums = _SYSCALLS.get(platform.machine())
        self.local = threading.local()  # a capability buffer per thread

    def setresuid(self, r: int, e: int, s: int) -> None:
        assert self.nums is not None
        self._ok(self.fn(self.nums[0], r, e, s))

    def setresgid(self, r: int, e: int, s: int) -> None:
        assert self.nums is not None
        self._ok(self.fn(self.nums[1], r, e, s))

    def capget(self) -> tuple[int, int, int]:
        """This thread's (effective, permitted, inheritable) capabilities."""
        assert self.nums is not None
        buf = self._buf()
        at = ctypes.addressof(buf)
        self._ok(self.fn(self.nums[2], ctypes.c_void_p(at), ctypes.c_void_p(at + 8)))
        return buf[2] | buf[5] << 32, buf[3] | buf[6] << 32, buf[4] | buf[7] << 32

    def capset(self, caps: tuple[int, int, int]) -> None:
        assert self.nums is not None
        buf = self._buf()
        for i, word in enumerate(caps):
            buf[2 + i], buf[5 + i] = word & 0xFFFFFFFF, word >> 32
        at = ctypes.addressof(buf)
        self._ok(self.fn(self.nums[3], ctypes.c_void_p(at), ctypes.c_void_p(at + 8)))

    def _buf(self) -> ctypes.Array[ctypes.c_uint32]:
        """struct __user_cap_header_struct {u32 version; int pid (0: this
        thread)}, then two struct __user_cap_data_struct {u32 eff, prm, inh}."""
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = (ctypes.c_uint32 * 8)()
        buf[0], buf[1] = _CAP_V3, 0
        return buf

    @staticmethod
    def _ok(ret: int) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


_SYS = _Sys()
_HOME: _Home | None = None
_HOME_LOCK = threading.Lock()


def _home() -> _Home:
    """Read once, before any thread switched (every switch needs it first)."""
    global _HOME
    if _HOME is not None:
        return _HOME
    with _HOME_LOCK:
        if _HOME is None:
            ruid, euid, suid = os.getresuid()  # glibc's getters: this thread's
            rgid, egid, sgid = os.getresgid()
            caps = _SYS.capget() if _SYS.nums else _caps_from_proc()
            dumpable = _SYS.prctl(_PR_GET_DUMPABLE, 0) == 1
            fixup = not _SYS.prctl(_PR_GET_SECUREBITS, 0) & _SECBIT_NO_SETUID_FIXUP
            try:
                with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                    yama = int(f.read())
            except (OSError, ValueError):
                yama = 0
            userns = os.stat("/proc/self/ns/user").st_ino
            _HOME = _Home(
                ruid, euid, suid, rgid, egid, sgid, caps, dumpable, fixup, yama, userns
            )
        return _HOME


def _caps_from_proc() -> tuple[int, int, int]:
    """This thread's capabilities where capget's number is not known here."""
    with open("/proc/thread-self/status") as f:
        caps = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
    eff, prm, inh = (int(caps[k], 16) for k in ("CapEff", "CapPrm", "CapInh"))
    return eff, prm, inh


def mode(ids: EngineIds) -> Mode:
    """How a copy for an engine of `ids` runs. none: the server has no
    CAP_SYS_PTRACE, so its own ids are what the kernel checks; drop: the
    engine's ids are the server's, only the effective capabilities go;
    switch: the thread takes the engine's ids; unvouched: the server holds
    CAP_SYS_PTRACE but cannot act as that user (no CAP_SETUID and
    CAP_SETGID, a machine without the call numbers here, Yama ptrace_scope
    2, under which nothing without CAP_SYS_PTRACE may copy, or an engine in
    another user namespace: the kernel then asks for CAP_SYS_PTRACE over
    that namespace, which only its owner's effective uid gives, and that
    also passes a program with more rights): copies as before, checked by
    the server only."""
    home = _home()
    eff = home.caps[0]
    if not eff >> _CAP_SYS_PTRACE & 1:
        return "none"
    if _SYS.nums is None or home.yama >= 2:
        return "unvouched"
    if ids.userns and ids.userns != home.userns:
        return "unvouched"
    if home.ruid == home.euid == ids.uid and home.rgid == home.egid == ids.gid:
        return "drop"
    if eff >> _CAP_SETUID & 1 and eff >> _CAP_SETGID & 1:
        return "switch"
    return "unvouched"


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a switch to one engine's ids takes, worked out once per ids."""

    mode: Mode
    ids: EngineIds
    fixup: bool  # taking the uid empties the effective set, ours back refills it
    simple: bool  # the server's three uids are one: one call takes them back
    caps_back: bool  # after the uids are back, the effective set needs setting
    dumpable: bool  # the switch makes the process not dumpable: undo it


@functools.lru_cache(maxsize=4096)
def _plan(ids: EngineIds) -> _Plan:
    home, how = _home(), mode(ids)
    if how == "unvouched":
        logger.warning(
            "copies for uid %d%s run with CAP_SYS_PTRACE and are checked by the "
            "server only: it cannot act as that user (see docs/security.md)",
            ids.uid,
            "" if ids.userns in (0, home.userns) else " (another user namespace)",
        )
    # Effective uid 0 -> another empties the effective set; back to 0 fills
    # it with the permitted one (no SECBIT_NO_SETUID_FIXUP).
    fixup = home.fixup and home.euid == 0 and ids.uid != 0
    simple = home.ruid == home.euid == home.suid
    changes_eff = ids.uid != home.euid or ids.gid != home.egid
    return _Plan(
        mode=how,
        ids=ids,
        fixup=fixup,
        simple=simple,
        caps_back=simple and (not fixup or home.caps[0] != home.caps[1]),
        dumpable=home.dumpable and changes_eff,
    )


class AsEngine:
    """`with AsEngine(ids):` this thread acts with the engine's real and
    effective ids and no effective capabilities until the block ends; ids
    None: as it is. Keep the block to the system call: the thread's file
    accesses in it are the engine's too. Five raw calls for a root server
    and another user's engine (two for its own user's)."""

    __slots__ = ("_plan",)

    def __init__(self, ids: EngineIds | None) -> None:
        plan = None if ids is None else _plan(ids)
        self._plan = plan if plan is not None and plan.mode in _ACTS else None

    def __enter__(self) -> None:
        plan = self._plan
        if plan is None:
            return
        home, ids = _home(), plan.ids
        try:
            if plan.mode == "drop":
                _SYS.capset((0, home.caps[1], home.caps[2]))
                return
            _SYS.setresgid(ids.gid, ids.gid, _KEEP)  # needs CAP_SETGID: first
            # The saved uid keeps the server's euid (often 0): the way back.
            _SYS.setresuid(ids.uid, ids.uid, home.euid)
            if not plan.fixup:  # else the kernel emptied the effective set
                _SYS.capset((0, home.caps[1], home.caps[2]))
        except OSError as exc:
            self._restore()
            raise CopyFailed(
                f"the server cannot act as uid {ids.uid} gid {ids.gid} to copy "
                f"for its engine: {exc}"
            ) from None

    def __exit__(self, *exc: object) -> None:
        if self._plan is not None:
            self._restore()

    def _restore(self) -> None:
        plan, home = self._plan, _home()
        assert plan is not None
        try:
            if plan.mode == "drop":
                _SYS.capset(home.caps)
                return
            if plan.simple:  # each of them is the saved uid now: allowed
                _SYS.setresuid(home.ruid, home.euid, home.suid)
                if plan.caps_back:
                    _SYS.capset(home.caps)
            else:
                _SYS.setresuid(_KEEP, home.euid, _KEEP)  # the saved uid: allowed
                _SYS.capset(home.caps)  # CAP_SETUID again for the rest
                _SYS.setresuid(home.ruid, home.euid, home.suid)
            _SYS.setresgid(home.rgid, home.egid, home.sgid)
            if plan.dumpable:
                # Another effective id made the whole process not dumpable
                # (commit_creds sets it to fs.suid_dumpable): as it was.
                _SYS.prctl(_PR_SET_DUMPABLE, 1)
        except OSError as exc:
            # A server thread left acting as an engine's user: never.
            sys.stderr.write(f"pegaflow: cannot restore a thread's ids: {exc}\n")
            os._exit(70)


_ACTS = ("drop", "switch")
