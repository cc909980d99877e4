"""Which host memory an engine may register: anonymous and shared memory are
copied, byte-checked; a region mapping a file on a disk or network filesystem
is refused at registration (its pages can hold a copy, and the loop or thread
doing it, on I/O: a FUSE daemon need never answer)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common import mounts
from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import Transfers
from pegaflow.copiers import vm
from pegaflow.copiers.host_copier import HostCopyEngine
from pegaflow.copiers.layer_signals import LayerSignals

SIZE = 1 << 16

# Maps SIZE bytes of the asked kind, fills them with a seeded pattern, prints
# pid and address, then waits for stdin to close.
CHILD = r"""
import mmap, os, sys
import numpy as np
kind, arg, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
size = int(sys.argv[4])
if kind == "anon":
    mm = mmap.mmap(-1, size)
elif kind == "anon-shared":
    mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
elif kind == "memfd":
    fd = os.memfd_create("kv")
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
else:  # "file": a file at arg, shared mapping
    fd = os.open(arg, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size)
buf = np.frombuffer(mm, np.uint8)
buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(size), np.uint8)
print(os.getpid(), buf.ctypes.data, flush=True)
sys.stdin.read()
"""


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen[str]] = []

    def start(kind: str, arg: str = "-", seed: int = 1) -> tuple[int, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, arg, str(seed), str(SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        pid, addr = map(int, proc.stdout.readline().split())
        return pid, addr

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _fstype(path: Path) -> str | None:
    got = (mounts.mount_table() or {}).get(mounts.device_name(os.stat(path).st_dev))
    return None if got is None else got[0]


def _disk_dir(tmp_path: Path) -> Path:
    """A directory on a filesystem that is not memory (the repo's, else the
    test's temp dir), or skip."""
    for d in (Path(__file__).resolve().parent, tmp_path, Path("/var/tmp")):
        probe = d / f".mapping-probe-{os.getpid()}"
        try:
            probe.touch()
        except OSError:
            continue
        try:
            fstype = _fstype(probe)
        finally:
            probe.unlink()
        if fstype is not None and fstype not in mounts.MEMORY_FILESYSTEMS:
            return d
    pytest.skip("no writable directory on a disk filesystem here")


@pytest.mark.parametrize("kind", ["anon", "anon-shared", "memfd", "shm"])
def test_memory_regions_register_and_copy(spawn, kind: str) -> None:
    arg = "-"
    if kind == "shm":
        if _fstype(Path("/dev/shm")) != "tmpfs":
            pytest.skip("/dev/shm is not tmpfs here")
        kind, arg = "file", f"/dev/shm/pegaflow-test-{os.getpid()}"
    try:
        pid, addr = spawn(kind, arg, seed=5)
        engine = HostCopyEngine(threads=1)
        regions = engine.open(pid, [(addr, SIZE)])
        got = np.zeros(SIZE, np.uint8)
        one = np.array([SIZE], np.uint64)
        engine.gather(
            regions,
            Transfers(
                np.array([addr], np.uint64), np.array([got.ctypes.data], np.uint64), one
            ),
        )
        want = np.frombuffer(np.random.default_rng(5).bytes(SIZE), np.uint8)
        assert np.array_equal(got, want)
        engine.close(regions)
    finally:
        if arg != "-":
            Path(arg).unlink(missing_ok=True)


def test_file_backed_region_is_refused_naming_it(spawn, tmp_path: Path) -> None:
    path = _disk_dir(tmp_path) / f".pegaflow-kv-{os.getpid()}"
    try:
        pid, addr = spawn("file", str(path))
        fstype = _fstype(path)
        engine = HostCopyEngine(threads=1)
        with pytest.raises(InvalidRequest) as err:
            engine.open(pid, [(addr, SIZE)])
        msg = str(err.value)
        assert msg.startswith("regions[0]: ")
        assert f"maps {path} on {fstype}" in msg and "stall" in msg
        # A region beside it is fine: only the overlap counts.
        other_pid, other = spawn("anon")
        engine.close(engine.open(other_pid, [(other, SIZE)]))
        # Layer signal words are checked the same way.
        with pytest.raises(InvalidRequest, match=r"^layer_signals\.address: .* maps "):
            LayerSignals(pid, addr, 4)
    finally:
        path.unlink(missing_ok=True)


def test_a_device_the_engine_mounts_lack_is_not_memory(monkeypatch) -> None:
    """A file of a mount the engine's namespace does not list (a FUSE mount
    of another namespace whose file was handed in) is refused; the kernel's
    own shmem device (memfd, shared anonymous memory) never is."""
    (shmem,) = sorted(mounts.kernel_memory_devices())[:1]
    major, minor = (int(x) for x in shmem.split(":"))
    lines = [
        f"7f0000000000-7f0000010000 rw-s 00000000 {major:02x}:{minor:02x} 42"
        "    /memfd:kv (deleted)",
        "7f0000010000-7f0000020000 rw-s 00000000 fe:07 43    /mnt/x/kv.bin",
        "7f0000020000-7f0000030000 rw-p 00000000 00:00 0",
    ]
    monkeypatch.setattr(mounts, "mount_table", lambda pid: {"254:0": ("ext4", "/")})
    one = np.array([1 << 16], np.uint64)
    memfd, foreign, anon = (np.array([a], np.uint64) for a in (
        0x7F0000000000, 0x7F0000010000, 0x7F0000020000))  # fmt: skip
    assert vm.file_backed(1, lines, memfd, one) is None
    assert vm.file_backed(1, lines, anon, one) is None
    got = vm.file_backed(1, lines, foreign, one)
    assert got == (0, "/mnt/x/kv.bin on device 254:7, which the engine's mounts lack")
    both = np.array([0x7F0000000000, 0x7F000000F000], np.uint64)
    assert vm.file_backed(1, lines, both, np.array([4096, 8192], np.uint64))[0] == 1
