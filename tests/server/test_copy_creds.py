"""The kernel vouches for every copy into an engine (issue 30 #1, the residual).

The server checks an engine process (pidfds.ProcessImage) before each copy
batch, but the copy's system call (process_vm_readv/writev) names the process
by pid: an exec that lands after the check reached the new program, a
setuid-root one included. Now each call acts with the engine user's own
credentials (pegaflow.common.thread_creds), so the kernel's ptrace test, made
in the call under the lock an exec takes, refuses a program with rights that
user lacks.

The window between check and call cannot be hit on cue from outside, so
these tests use a state in which the server's check passes (or is left out)
although the program changed: the engine (uid 65534) starts a
clone(CLONE_VM) child that keeps its old address space alive, then exec's
the setuid-root helper of test_exec_identity, which maps a secret where the
engine's memory was. A layer signal after a load's first layer checks only
that the address space lives (the server's own shortcut), so before this
change it wrote into the root program; a host copy batch is shown with its
check left out (the state the race leaves). The copier objects are the
server's own, in this (root) process, against real processes.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common.errors import PermissionDenied
from pegaflow.common.geometry import Transfers
from pegaflow.common.pidfds import ProcessChanged
from pegaflow.copiers.host_copier import HostCopyEngine
from pegaflow.copiers.layer_signals import LayerSignals
from tests.procs import ROOT, _env
from tests.server import test_exec_identity
from tests.server.test_exec_identity import (
    ADDR,
    SHARE_THEN,
    _finish,
    _prelude,
    _wait_ready,
    needs_root_and_cc,
)
from tests.server.test_trust import NOBODY

# The fixture: the setuid-root program, built once per module.
helper = test_exec_identity.helper

SIZE = 8 << 20  # past PARALLEL_MIN_BYTES: the copy's pool threads act too

# uid 65534: maps SIZE bytes of 0x11 at ADDR, says so, and on a line from
# the test starts the sharing child and becomes the setuid-root helper.
ENGINE = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                      ctypes.c_int, ctypes.c_int, ctypes.c_long)
assert libc.mmap({addr}, {size}, 3, 0x22 | 0x100000, -1, 0) == {addr}
ctypes.memset({addr}, 0x11, {size})
print('mapped', flush=True)
sys.stdin.readline()
{share}
os.execv({helper!r}, [{helper!r}, hex({addr}), str({size})])
"""


@contextmanager
def engine(helper: Path) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """The engine as uid 65534, its buffer mapped; [the sharer's pid] once
    exec_helper() ran. Ends with the helper's verdict: its secret intact."""
    code = ENGINE.format(addr=ADDR, size=SIZE, share=SHARE_THEN, helper=str(helper))
    proc = subprocess.Popen(
        [sys.executable, "-c", _prelude(NOBODY) + code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=_env(), cwd=ROOT, text=True,
    )  # fmt: skip
    sharer: list[int] = []
    try:
        assert proc.stdout.readline().strip() == "mapped", proc.stderr.read()
        yield proc, sharer
    finally:
        for pid in sharer:
            os.kill(pid, signal.SIGKILL)
        _finish(proc)  # the helper's secret was never written


def exec_helper(proc: subprocess.Popen, helper: Path, sharer: list[int]) -> None:
    """The engine starts its address-space sharer and exec's the setuid-root
    helper; back once the helper runs with root's rights."""
    proc.stdin.write("go\n")
    proc.stdin.flush()
    tag, pid = proc.stdout.readline().split()
    assert tag == "sharer" and int(pid) > 0, (tag, pid)
    sharer.append(int(pid))
    _wait_ready(proc, helper)


@needs_root_and_cc
def test_a_layer_signal_never_reaches_a_setuid_program(helper: Path) -> None:
    """A load's first layer signal checks the engine's rights; later ones only
    that its address space lives, which the sharer keeps true after the
    engine exec'd the setuid-root helper. Before, the word for layer 1 was
    written into the root program (its secret at the signal address);
    now the kernel, asked as uid 65534, refuses: PERMISSION_DENIED, naming
    the refusal."""
    with engine(helper) as (proc, sharer):
        signals = LayerSignals(proc.pid, ADDR, 4)
        try:
            signals.signal(0, 7)  # the engine as it registered: written
            exec_helper(proc, helper, sharer)
            with pytest.raises(PermissionDenied) as err:
                signals.signal(1, 0x4141414141414141)
        finally:
            signals.close()
    assert isinstance(err.value, ProcessChanged)  # the registration ends
    assert f"refused by the kernel (EPERM) with the rights of uid {NOBODY}" in str(
        err.value
    )


@needs_root_and_cc
def test_a_host_copy_never_reaches_a_setuid_program(helper: Path) -> None:
    """The host copy path, both directions, over two copy threads: the
    engine's own memory round-trips; after it exec'd the setuid-root helper,
    the server's check refuses the batch, and a batch that got past it (the
    race's state: the check left out here) is refused by the kernel - no
    byte of the root program read, none written."""
    copier = HostCopyEngine(threads=2)
    local = np.full(SIZE, 0x3C, np.uint8)
    back = np.zeros(SIZE, np.uint8)
    here = np.array([local.ctypes.data], np.uint64)
    there = np.array([ADDR], np.uint64)
    size = np.array([SIZE], np.uint64)
    to_engine = Transfers(here, there, size)
    from_engine = Transfers(there, np.array([back.ctypes.data], np.uint64), size)
    try:
        with engine(helper) as (proc, sharer):
            regions = copier.open(proc.pid, [(ADDR, SIZE)])
            try:
                copier.scatter(regions, to_engine)
                copier.gather(regions, from_engine)
                assert np.array_equal(back, local)  # as uid 65534: every byte
                back[:] = 0
                exec_helper(proc, helper, sharer)
                with pytest.raises(ProcessChanged, match="changed credentials"):
                    copier.scatter(regions, to_engine)  # the server's check
                # The same registration with the check left out: what a batch
                # that passed its check just before the exec goes on with.
                unchecked = dataclasses.replace(regions, image=None)
                for op, t in (("scatter", to_engine), ("gather", from_engine)):
                    with pytest.raises(ProcessChanged) as err:
                        getattr(copier, op)(unchecked, t)
                    assert str(err.value).startswith(f"{op} with engine process")
                    assert "refused by the kernel (EPERM)" in str(err.value)
            finally:
                copier.close(regions)
        assert not back.any()  # nothing of the root program read
    finally:
        copier.shutdown()
