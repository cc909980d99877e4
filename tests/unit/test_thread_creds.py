"""A copy thread acts with the engine's credentials (issue 30 #1): the
kernel's own ptrace test in process_vm_readv/writev then judges the process as
it is at the call, which a check of the server's before the call cannot.

Real processes: a root one that is not dumpable (what a setuid program's exec
makes a process), a root one that is, and one of uid 65534.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from pegaflow.common.errors import PermissionDenied
from pegaflow.common.pidfds import ProcessImage
from pegaflow.common.thread_creds import _SYS, AsEngine, EngineIds, _home, mode
from pegaflow.copiers.vm import WRITEV, iovecs, transfer

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (CAP_SYS_PTRACE, another uid's process)"
)

# A process with 64 bytes of 0x11 whose address it prints; when its stdin
# closes it prints their hex. As `uid` (dumpable, as that user's own process
# would be) or, uid None, as root; dumpable 0: PR_SET_DUMPABLE 0.
TARGET = """
import ctypes, os, sys
libc = ctypes.CDLL(None)
if {uid} is not None:
    os.setgroups([]); os.setgid({uid}); os.setuid({uid})
libc.prctl(4, {dumpable})
buf = ctypes.create_string_buffer(b'\\x11' * 64, 64)
print(ctypes.addressof(buf), flush=True)
sys.stdin.read()
print(buf.raw.hex())
"""


@contextmanager
def target(uid: int | None, dumpable: int) -> Iterator[tuple[int, int, list[str]]]:
    """(pid, address, [its bytes' hex, once it ended])."""
    code = TARGET.format(uid=uid, dumpable=dumpable)
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out: list[str] = []
    try:
        addr = int(proc.stdout.readline())
        yield proc.pid, addr, out
    finally:
        proc.stdin.close()
        out.append(proc.stdout.read().strip())
        proc.wait(30)


def _write(pid: int, addr: int, data: bytes) -> tuple[int, int]:
    """process_vm_writev of data at addr: (return value, errno)."""
    src = np.frombuffer(data, np.uint8).copy()
    n = np.array([len(data)], np.uint64)
    local = iovecs(np.array([src.ctypes.data], np.uint64), n)
    remote = iovecs(np.array([addr], np.uint64), n)
    got = WRITEV(pid, local.ctypes.data, 1, remote.ctypes.data, 1, 0)
    return got, ctypes.get_errno() if got < 0 else 0


def _thread_ids(tid: int) -> tuple[str, str]:
    """The Uid: and Gid: lines of a thread, as the kernel reports them."""
    with open(f"/proc/self/task/{tid}/status") as f:
        lines = f.read().splitlines()
    pick = [ln.split(":", 1)[1].split() for ln in lines if ln[:4] in ("Uid:", "Gid:")]
    return " ".join(pick[0]), " ".join(pick[1])


@needs_root
def test_a_thread_acts_as_the_engine_and_only_it() -> None:
    """Switched to uid 65534's credentials, a thread's process_vm_writev into a
    root process that is not dumpable is refused (EPERM) and into a uid 65534
    process goes through; meanwhile the other threads keep root's ids and
    capabilities, and afterwards the thread has its own back and the process
    is still dumpable."""
    home = _home()
    ids = EngineIds(NOBODY, NOBODY)
    assert mode(ids) == "switch"
    seen: dict[str, object] = {}
    inside, done = threading.Event(), threading.Event()

    def copier(root_pid: int, root_addr: int, pid: int, addr: int) -> None:
        seen["tid"] = threading.get_native_id()
        try:
            with AsEngine(ids):
                seen["root"] = _write(root_pid, root_addr, b"\x5a" * 8)
                seen["nobody"] = _write(pid, addr, b"\x5a" * 8)
                seen["ids"] = os.getresuid(), os.getresgid()
                inside.set()
                done.wait(60)
            seen["after"] = os.getresuid(), os.getresgid(), _SYS.capget()
        finally:
            inside.set()

    with (
        target(None, 0) as (rpid, raddr, rout),
        target(NOBODY, 1) as (npid, naddr, nout),
    ):
        t = threading.Thread(target=copier, args=(rpid, raddr, npid, naddr))
        t.start()
        assert inside.wait(60)
        try:
            assert seen["root"] == (-1, 1), seen  # EPERM: the kernel's word
            assert seen["nobody"] == (8, 0), seen
            assert seen["ids"] == ((NOBODY,) * 2 + (0,), (NOBODY,) * 2 + (0,))
            # This (main) thread, meanwhile: root, all its capabilities.
            assert os.getresuid() == (home.ruid, home.euid, home.suid)
            assert _SYS.capget() == home.caps
            assert _thread_ids(threading.get_native_id())[0].startswith("0 0 0")
            assert _thread_ids(seen["tid"])[0] == f"{NOBODY} {NOBODY} 0 {NOBODY}"
        finally:
            done.set()
            t.join(60)
    assert rout == ["11" * 64]
    assert nout == ["5a" * 8 + "11" * 56]
    assert seen["after"] == (
        (home.ruid, home.euid, home.suid),
        (home.rgid, home.egid, home.sgid),
        home.caps,
    )
    assert _SYS.prctl(3, 0) == 1  # PR_GET_DUMPABLE: as before


@needs_root
def test_a_root_engine_copies_without_cap_sys_ptrace() -> None:
    """An engine of the server's own user (root here): no id to take, but
    CAP_SYS_PTRACE leaves the effective set, so a root process that became
    not dumpable is refused while a dumpable one is written."""
    ids = EngineIds(_home().ruid, _home().rgid)
    assert mode(ids) == "drop"
    with target(None, 0) as (pid, addr, out), target(None, 1) as (pid2, addr2, out2):
        with AsEngine(ids):
            refused = _write(pid, addr, b"\x5a" * 8)
            written = _write(pid2, addr2, b"\x5a" * 8)
        assert _SYS.capget() == _home().caps
    assert (refused, written) == ((-1, 1), (8, 0))
    assert out == ["11" * 64]
    assert out2 == ["5a" * 8 + "11" * 56]


@needs_root
def test_a_copy_the_kernel_refuses_is_permission_denied() -> None:
    """vm.transfer with the engine's ids into a process that no longer is
    what that user may touch: PERMISSION_DENIED naming the kernel's refusal,
    no byte written (without ids the root server would have written)."""
    src = np.full(16, 0x5A, np.uint8)
    n = np.array([16], np.uint64)
    with target(None, 0) as (pid, addr, out):
        local = iovecs(np.array([src.ctypes.data], np.uint64), n)
        remote = iovecs(np.array([addr], np.uint64), n)
        with pytest.raises(PermissionDenied) as err:
            transfer("scatter", pid, local, remote, ids=EngineIds(NOBODY, NOBODY))
    msg = str(err.value)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"refused by the kernel (EPERM) with the rights of uid {NOBODY}" in msg
    assert out == ["11" * 64]


# Unshares a user namespace (owned by root, who starts it), waits until the
# test maps its uid 0 to uid 65534 outside, becomes that user, and then acts
# as TARGET does.
IN_USERNS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000) == 0, ctypes.get_errno()  # CLONE_NEWUSER
print('unshared', flush=True)
sys.stdin.readline()
os.setgid(0); os.setuid(0)
libc.prctl(4, 1)
buf = ctypes.create_string_buffer(b'\\x11' * 64, 64)
print(ctypes.addressof(buf), flush=True)
sys.stdin.read()
print(buf.raw.hex())
"""


@needs_root
def test_an_engine_in_another_user_namespace_still_copies() -> None:
    """A process in a user namespace that root created (a container's, say),
    uid 65534 outside: acting as uid 65534, the kernel would ask the thread
    for CAP_SYS_PTRACE over that namespace and refuse even the plain engine,
    so such an engine is copied as before (checked by the server only), and
    registers and copies as it did."""
    proc = subprocess.Popen(
        [sys.executable, "-c", IN_USERNS],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "unshared"
        for name, text in (("uid_map", f"0 {NOBODY} 1"), ("setgroups", "deny")):
            with open(f"/proc/{proc.pid}/{name}", "w") as f:
                f.write(text + "\n")
        with open(f"/proc/{proc.pid}/gid_map", "w") as f:
            f.write(f"0 {NOBODY} 1\n")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        addr = int(proc.stdout.readline())
        image = ProcessImage(proc.pid)
        try:
            ids = image.ids
            assert (ids.uid, ids.gid) == (NOBODY, NOBODY)
            assert ids.userns not in (0, _home().userns)
            assert mode(ids) == "unvouched"
            with AsEngine(EngineIds(NOBODY, NOBODY)):  # what it would meet
                refused = _write(proc.pid, addr, b"\x5a" * 8)
            assert refused == (-1, 1)
            src = np.full(8, 0x5A, np.uint8)
            n = np.array([8], np.uint64)
            local = iovecs(np.array([src.ctypes.data], np.uint64), n)
            remote = iovecs(np.array([addr], np.uint64), n)
            transfer("scatter", proc.pid, local, remote, ids=ids)
        finally:
            image.close()
    finally:
        proc.stdin.close()
        out = proc.stdout.read().strip()
        proc.wait(30)
    assert out == "5a" * 8 + "11" * 56
