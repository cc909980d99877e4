"""A host engine's pid handed on to another process while the server checks
or copies: the checks must have been of the process registered, and a save
must not publish what it read from a successor.

Pid reuse is made to happen on cue: the scenario runs as pid 1 of a fresh pid
namespace (unshare, root), where writing /proc/sys/kernel/ns_last_pid makes the
next child take the pid just freed. Both engines map their KV buffer at one
fixed address, so a registration that opens the successor's memory succeeds
unless the server notices the swap.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_unshare(), reason="needs root and unshare(1) for a private pid namespace"
)

SCENARIO = textwrap.dedent(
    r"""
    import os, subprocess, sys
    import numpy as np
    from pegaflow.cache import instances
    from pegaflow.copiers.host_copier import HostCopyEngine
    from pegaflow.errors import CopyFailed, InvalidRequest
    from pegaflow.common.geometry import LayerLayout, Segment, Transfers
    from pegaflow.common.identity import Caller, check_host_memory_owner
    from pegaflow.cache.registration_checks import RegisterSpec

    ADDR, SIZE, PAGE = 0x7E0000000000, 1 << 20, 4096
    ENGINE = f'''
    import ctypes, sys
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long)
    # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS|FIXED_NOREPLACE
    assert libc.mmap({ADDR}, {SIZE}, 3, 0x22 | 0x100000, -1, 0) == {ADDR}
    ctypes.memset({ADDR}, int(sys.argv[1]), {SIZE})
    print("ready", flush=True)
    sys.stdin.read()
    '''

    def engine(fill):
        p = subprocess.Popen([sys.executable, "-c", ENGINE, str(fill)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n"
        return p

    def successor(old):
        # Free old's pid and hand it to a new engine that fills its buffer with 7.
        old.kill()
        old.wait()
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(old.pid - 1))
        new = engine(7)
        assert new.pid == old.pid, (new.pid, old.pid)
        return new

    copier = HostCopyEngine(threads=1)
    layers = tuple(
        LayerLayout(0, i * 16 * PAGE, 16, PAGE, (Segment(0, PAGE),)) for i in range(4)
    )
    live = []

    # 1. The pid changes hands between the caller's check and the open.
    first = engine(1)
    live.append(first)

    def check_then_swap(pid, caller, field, allow_tcp):
        check_host_memory_owner(pid, caller, field, allow_tcp)
        live.append(successor(first))

    instances.check_host_memory_owner = check_then_swap
    registry = instances.Registry({"host": copier})
    spec = RegisterSpec("eng", "ns", 0, 1, 1, "cpu", "host", first.pid,
                        ((ADDR, SIZE),), layers)
    try:
        registry.register(spec, Caller("unix", first.pid, 0))
        print("registered the successor")
    except InvalidRequest as exc:
        print("refused:", exc)

    # 2. The engine exits mid-save and its pid goes to another process.
    instances.check_host_memory_owner = check_host_memory_owner
    second = engine(2)
    live.append(second)
    regions = copier.open(second.pid, [(ADDR, SIZE)])
    from pegaflow.copiers import host_copier as hostmod
    real_transfer = hostmod.transfer

    def swap_then_read(op, pid, liov, riov, deadline=None, ids=None):
        live.append(successor(second))
        real_transfer(op, pid, liov, riov, deadline, ids=ids)

    hostmod.transfer = swap_then_read
    pool = np.zeros(PAGE, np.uint8)
    t = Transfers(np.array([ADDR], np.uint64), np.array([pool.ctypes.data], np.uint64),
                  np.array([PAGE], np.uint64))
    try:
        copier.gather(regions, t)
        print("saved bytes of", int(pool[0]))
    except CopyFailed as exc:
        print("save failed:", exc)
    for p in live:
        p.kill()
    """
)


def test_pid_reused_during_registration_or_copy_is_caught(tmp_path: Path) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [*UNSHARE, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("refused: regions.host.pid: process ")
    assert lines[0].endswith("exited while registering")
    assert lines[1].startswith("save failed: gather: engine process ")
    assert lines[1].endswith("exited mid-copy")
