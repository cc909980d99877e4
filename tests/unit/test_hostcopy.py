"""Host copy engine against real child processes, every byte checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pegaflow.common.errors import CopyFailed, InternalError, InvalidRequest
from pegaflow.common.geometry import KVGeometry, LayerLayout, Segment, Transfers
from pegaflow.copiers import host_copier as hostcopy
from pegaflow.copiers import vm
from pegaflow.copiers.host_copier import HostCopyEngine
from pegaflow.copiers.vm import IOV_MAX

PAGE = 4096
SIZE = 4 << 20

Pieces = list[tuple[int, np.ndarray]]  # (destination offset, bytes)

# The child maps an anonymous buffer (page aligned, so it can mprotect pages),
# fills it from the seed, prints pid and address, then obeys stdin commands.
CHILD = r"""
import ctypes, mmap, os, sys
import numpy as np
size, seed = int(sys.argv[1]), int(sys.argv[2])
mm = mmap.mmap(-1, size + 4096)
buf = np.frombuffer(mm, np.uint8)[:size]
libc = ctypes.CDLL(None)
# A PROT_NONE guard page, so the byte after the buffer is never read-write.
assert libc.mprotect(ctypes.c_void_p(buf.ctypes.data + size), 4096, 0) == 0
buf[:] = np.frombuffer(np.random.default_rng(seed).bytes(size), np.uint8)
print(os.getpid(), buf.ctypes.data, flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "dump":
        buf.tofile(args[0])
    elif cmd == "protect":  # PROT_NONE on [offset, offset + length)
        off, length = int(args[0]), int(args[1])
        assert libc.mprotect(ctypes.c_void_p(buf.ctypes.data + off), length, 0) == 0
    print("ok", flush=True)
"""


@dataclass
class Child:
    proc: subprocess.Popen[str]
    pid: int
    base: int
    expected: np.ndarray  # what the child's buffer should hold now

    def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok"

    def contents(self, tmp: Path) -> np.ndarray:
        self.command(f"dump {tmp / 'dump.bin'}")
        return np.fromfile(tmp / "dump.bin", np.uint8)


@pytest.fixture
def child() -> Iterator[Child]:
    seed = int.from_bytes(os.urandom(4), "little")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(SIZE), str(seed)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pid, base = map(int, proc.stdout.readline().split())
    expected = np.frombuffer(np.random.default_rng(seed).bytes(SIZE), np.uint8)
    yield Child(proc, pid, base, expected.copy())
    proc.kill()
    proc.wait()


@pytest.fixture
def engine() -> Iterator[HostCopyEngine]:
    eng = HostCopyEngine(threads=2)
    yield eng
    eng.shutdown()


def reference(t: Transfers, src: np.ndarray, src_base: int, dst_base: int) -> Pieces:
    """(dst offset, bytes) per descriptor, read from a copy of the source."""
    return [
        (d - dst_base, src[s - src_base : s - src_base + n].copy())
        for s, d, n in zip(
            t.src.tolist(), t.dst.tolist(), t.nbytes.tolist(), strict=True
        )
    ]


def apply(target: np.ndarray, pieces: Pieces) -> None:
    for off, data in pieces:
        target[off : off + len(data)] = data


def lbnhc(base: int) -> KVGeometry:
    """4 layers x 64 blocks, each (layer, block) page one 8 KiB piece."""
    page = 8192
    layers = tuple(
        LayerLayout(0, i * 64 * page, 64, page, (Segment(0, page),)) for i in range(4)
    )
    return KVGeometry(layers, [base])


def kv_first(base: int) -> KVGeometry:
    """4 layers, each all K pages then all V pages: two 4 KiB segments."""
    half, blocks = 4096, 64
    seg = (Segment(0, half), Segment(blocks * half, half))
    layers = tuple(
        LayerLayout(0, i * 2 * blocks * half, blocks, half, seg) for i in range(4)
    )
    return KVGeometry(layers, [base])


@pytest.mark.parametrize("make", [lbnhc, kv_first])
def test_gather_then_scatter_into_other_blocks(
    child: Child,
    engine: HostCopyEngine,
    tmp_path: Path,
    make: Callable[[int], KVGeometry],
) -> None:
    """Random pages gathered into slots, then scattered into other block ids."""
    rng = np.random.default_rng()
    geo = make(child.base)
    ids = rng.choice(64, 40, replace=False)
    src_ids, dst_ids = ids[:20], ids[20:]
    pool = np.zeros(20 * geo.slot_bytes, np.uint8)
    slots = pool.ctypes.data + np.arange(20) * geo.slot_bytes
    regions = engine.open(child.pid, [(child.base, SIZE)])

    save = geo.engine_to_slots(src_ids, slots, np.arange(geo.num_layers))
    engine.gather(regions, save)
    want = np.zeros_like(pool)
    apply(want, reference(save, child.expected, child.base, pool.ctypes.data))
    assert np.array_equal(pool, want)

    load = geo.slots_to_engine(slots, dst_ids)
    engine.scatter(regions, load)
    apply(child.expected, reference(load, pool, pool.ctypes.data, child.base))
    assert np.array_equal(child.contents(tmp_path), child.expected)


def test_many_descriptors_take_several_calls(
    child: Child,
    engine: HostCopyEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3000 scattered 512 B pieces: >IOV_MAX iovecs, split over calls and threads."""
    counts: list[int] = []
    for name in ("READV", "WRITEV"):
        real = getattr(vm, name)
        monkeypatch.setattr(vm, name, lambda *a, f=real: counts.append(a[2]) or f(*a))
    n, piece = 3000, 512
    remote = child.base + np.random.default_rng().permutation(n) * 1024
    pool = np.zeros(n * piece, np.uint8)
    local = pool.ctypes.data + np.arange(n) * piece
    t = Transfers(
        remote.astype(np.uint64), local.astype(np.uint64), np.full(n, piece, np.uint64)
    )
    regions = engine.open(child.pid, [(child.base, SIZE)])
    counts.clear()  # open() probes with one read
    engine.gather(regions, t)
    assert len(counts) == 3 and max(counts) <= IOV_MAX
    want = np.zeros_like(pool)
    apply(want, reference(t, child.expected, child.base, pool.ctypes.data))
    assert np.array_equal(pool, want)

    pool[:] = np.frombuffer(os.urandom(pool.size), np.uint8)
    back = Transfers(t.dst, t.src, t.nbytes)
    engine.scatter(regions, back)
    apply(child.expected, reference(back, pool, pool.ctypes.data, child.base))
    assert np.array_equal(child.contents(tmp_path), child.expected)


def test_contiguous_blocks_coalesce_into_one_iovec(
    child: Child, engine: HostCopyEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of consecutive blocks into consecutive slots: one iovec, same bytes."""
    counts: list[int] = []
    real = vm.READV
    monkeypatch.setattr(vm, "READV", lambda *a: counts.append(a[2]) or real(*a))
    # One layer of 8 KiB pages: block b's page and slot b both advance by a page.
    geo = KVGeometry(
        (LayerLayout(0, PAGE, 64, 8192, (Segment(0, 8192),)),), [child.base]
    )
    pool = np.zeros(32 * geo.slot_bytes, np.uint8)
    slots = pool.ctypes.data + np.arange(32) * geo.slot_bytes
    t = geo.engine_to_slots(np.arange(10, 42), slots, np.array([0]))
    regions = engine.open(child.pid, [(child.base, SIZE)])
    counts.clear()
    engine.gather(regions, t)
    assert counts == [1]
    start = PAGE + 10 * 8192
    assert np.array_equal(pool, child.expected[start : start + pool.size])


def test_coalesce_merges_only_when_both_sides_continue() -> None:
    src = np.array([0, 10, 20, 100, 110], np.uint64)
    dst = np.array([50, 60, 75, 85, 95], np.uint64)
    n = np.array([10, 10, 10, 10, 10], np.uint64)
    s, d, m = hostcopy._coalesce(src, dst, n)
    assert s.tolist() == [0, 20, 100]
    assert d.tolist() == [50, 75, 85]
    assert m.tolist() == [20, 10, 20]


def test_ranges_may_span_adjacent_spans() -> None:
    starts, ends = vm.merge_spans(
        np.array([300, 100, 200, 500], np.uint64),
        np.array([400, 200, 250, 600], np.uint64),
    )
    assert starts.tolist() == [100, 300, 500] and ends.tolist() == [250, 400, 600]
    addr = np.array([100, 150, 300, 240, 450], np.uint64)
    n = np.array([150, 50, 100, 20, 10], np.uint64)
    assert vm.first_outside(starts, ends, addr, n) == 3
    assert vm.first_outside(starts, ends, addr[:3], n[:3]) == -1
    huge = np.array([2**64 - 1], np.uint64)  # wraps past 2**64
    assert vm.first_outside(starts, ends, addr[:1], huge) == 0


def test_advance_resumes_inside_an_iovec() -> None:
    liov = vm.iovecs(
        np.array([1000, 2000, 3000], np.uint64), np.array([10, 20, 30], np.uint64)
    )
    riov = vm.iovecs(np.array([7000, 8000, 9000], np.uint64), liov[:, 1].copy())
    left, right = vm.advance(liov, riov, 15)  # 5 bytes into the second
    assert left.tolist() == [[2005, 15], [3000, 30]]
    assert right.tolist() == [[8005, 15], [9000, 30]]
    left, right = vm.advance(liov, riov, 30)  # exactly at a boundary
    assert left.tolist() == [[3000, 30]] and right.tolist() == [[9000, 30]]


def test_out_of_region_descriptor_copies_nothing(
    child: Child, engine: HostCopyEngine, tmp_path: Path
) -> None:
    """One descriptor crossing the region end fails the batch before any syscall."""
    regions = engine.open(child.pid, [(child.base, SIZE // 2)])
    pool = np.zeros(3 * PAGE, np.uint8)
    local = pool.ctypes.data + np.arange(3, dtype=np.uint64) * PAGE
    remote = child.base + np.array([0, PAGE, SIZE // 2 - PAGE // 2], np.uint64)
    t = Transfers(remote, local, np.full(3, PAGE, np.uint64))
    with pytest.raises(InternalError, match=r"transfers\.src\[2\]"):
        engine.gather(regions, t)
    assert not pool.any()
    pool[:] = 7
    with pytest.raises(InternalError, match=r"transfers\.dst\[2\]"):
        engine.scatter(regions, Transfers(local, remote, t.nbytes))
    assert np.array_equal(child.contents(tmp_path), child.expected)


def test_open_rejects_bad_pid_and_unmapped_ranges(
    child: Child, engine: HostCopyEngine
) -> None:
    with pytest.raises(InvalidRequest, match=r"regions\[1\]: .* not mapped read-write"):
        engine.open(
            child.pid, [(child.base, SIZE), (child.base + SIZE - PAGE, 2 * PAGE)]
        )
    with pytest.raises(InvalidRequest, match=r"regions\[0\]"):
        engine.open(child.pid, [(PAGE, PAGE)])  # page 1 is never mapped
    with pytest.raises(InvalidRequest, match=r"regions\[0\]"):
        engine.open(child.pid, [(child.base, 0)])
    child.proc.kill()
    child.proc.wait()  # reaped: the pid no longer exists
    with pytest.raises(
        InvalidRequest, match=rf"pid: process {child.pid} does not exist"
    ):
        engine.open(child.pid, [(child.base, SIZE)])


def test_killed_engine_fails_the_copy(child: Child, engine: HostCopyEngine) -> None:
    """The engine dies after registering; its parent has not reaped it yet."""
    regions = engine.open(child.pid, [(child.base, SIZE)])
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie now
    pool = np.zeros(PAGE, np.uint8)
    t = Transfers(
        np.array([child.base], np.uint64),
        np.array([pool.ctypes.data], np.uint64),
        np.array([PAGE], np.uint64),
    )
    with pytest.raises(CopyFailed, match=rf"engine process {child.pid} is gone"):
        engine.gather(regions, t)
    with pytest.raises(CopyFailed, match=rf"engine process {child.pid} is gone"):
        engine.scatter(regions, Transfers(t.dst, t.src, t.nbytes))
    with pytest.raises(InvalidRequest, match=rf"pid: process {child.pid} has exited"):
        engine.open(child.pid, [(child.base, SIZE)])
    engine.scatter(regions, Transfers(t.dst[:0], t.src[:0], t.nbytes[:0]))  # no-op


def test_fault_midway_copies_up_to_it_then_fails(
    child: Child, engine: HostCopyEngine
) -> None:
    """A PROT_NONE page inside one long iovec: the call stops short, the resume
    from that byte faults, and everything before it has landed."""
    regions = engine.open(child.pid, [(child.base, SIZE)])
    child.command(f"protect {5 * PAGE} {PAGE}")
    pool = np.zeros(8 * PAGE, np.uint8)
    t = Transfers(
        np.array([child.base + PAGE], np.uint64),
        np.array([pool.ctypes.data], np.uint64),
        np.array([8 * PAGE], np.uint64),
    )
    with pytest.raises(CopyFailed, match=rf"EFAULT.*engine {child.base + 5 * PAGE:#x}"):
        engine.gather(regions, t)
    assert np.array_equal(pool[: 4 * PAGE], child.expected[PAGE : 5 * PAGE])
    assert not pool[4 * PAGE :].any()
