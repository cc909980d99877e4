"""pegaflow.client.host_share's process-wide record of the memfds it mapped
over this process's memory: pages a second caller names again get the same
memfd; a page a memfd of ours already backs is never mapped over again, as a
live registration's server mapping may rely on it (seen: a pipeline-parallel
test engine whose stage-0 loads all vanished, every page zero, after the
second stage's registration remapped the pages the first had shared)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.client import host_share
from pegaflow.client.host_share import PAGE, SharedMemory, share_memory
from pegaflow.common.memfd import unmap


def _region(pages: int) -> tuple[mmap.mmap, np.ndarray]:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # as glibc's heap
    m = mmap.mmap(-1, pages * PAGE, flags=flags)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = np.random.default_rng(pages).integers(0, 256, arr.size, np.uint8)
    return m, arr


def _backs(shared: SharedMemory, arr: np.ndarray, page: int) -> bool:
    """A write through the memfd shows at arr's page `page`."""
    at = arr.ctypes.data + page * PAGE
    span = next(s for s in shared.spans if s.address <= at < s.address + s.size)
    mark = os.urandom(16)
    os.pwrite(shared.fd, mark, span.offset + at - span.address)
    return bytes(arr[page * PAGE : page * PAGE + 16]) == mark


def test_the_same_pages_reuse_the_memfd_and_backed_pages_stay_backed() -> None:
    m, arr = _region(16)
    base = arr.ctypes.data
    want = arr.copy()
    first = share_memory([(base, 8 * PAGE)])
    assert first is not None and first.nbytes == 8 * PAGE
    assert np.array_equal(arr, want)  # every byte where it was
    again = share_memory([(base + PAGE, 2 * PAGE)])  # inside the first
    assert again is not None and again.fd != first.fd
    assert os.fstat(again.fd).st_ino == os.fstat(first.fd).st_ino
    assert again.spans[0].offset == PAGE
    # Half on the first: only the other half goes into a new memfd.
    later = share_memory([(base + 4 * PAGE, 8 * PAGE)])
    assert later is not None
    assert os.fstat(later.fd).st_ino != os.fstat(first.fd).st_ino
    assert [(s.address, s.size) for s in later.spans] == [(base + 8 * PAGE, 4 * PAGE)]
    assert _backs(first, arr, 4) and _backs(first, arr, 7)
    assert _backs(later, arr, 8) and _backs(later, arr, 11)
    # Mostly on the first: that memfd again, the one anonymous page left out.
    most = share_memory([(base + 5 * PAGE, 3 * PAGE), (base + 13 * PAGE, PAGE)])
    assert most is not None
    assert os.fstat(most.fd).st_ino == os.fstat(first.fd).st_ino
    assert [(s.address, s.size) for s in most.spans] == [(base + 5 * PAGE, 3 * PAGE)]
    for shared in (first, again, later, most):
        shared.close()
    del arr
    m.close()


def test_a_memfd_partly_unmapped_elsewhere_still_backs_its_live_pages() -> None:
    """A freed engine's memfd spans pages 0-11; a new engine's buffer lands on
    pages 0-7 and its first part shares them; then the allocator hands pages
    8-11 back (heap trim). The second part must get the first part's memfd:
    mapping a new one over pages 0-7 would cut the first part's server
    mapping off (the old code did, having reused the freed engine's memfd
    and then found it partly unmapped)."""
    m, arr = _region(16)
    base = arr.ctypes.data
    dead = share_memory([(base, 12 * PAGE)])
    assert dead is not None
    dead.close()
    del dead  # its engine is gone: its memfd's pages are free again
    stage0 = share_memory([(base, 8 * PAGE)])
    assert stage0 is not None
    unmap(base + 8 * PAGE, 4 * PAGE)
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED: regrown
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t) + (ctypes.c_int,) * 3
    libc.mmap.argtypes += (ctypes.c_long,)
    got = libc.mmap(base + 8 * PAGE, 4 * PAGE, 3, anon, -1, 0)
    assert got == base + 8 * PAGE
    _second_stage_shares_the_first_ones_memfd(stage0, arr)
    del arr
    m.close()


def test_pages_of_a_memfd_no_longer_in_use_move_into_a_new_one() -> None:
    """A SharedMemory that no longer lives (its engine closed) keeps no claim:
    a buffer landing on its pages gets a memfd of its own, bytes intact."""
    m, arr = _region(8)
    base = arr.ctypes.data
    old = share_memory([(base, 8 * PAGE)])
    assert old is not None
    old_inode = os.fstat(old.fd).st_ino
    old.close()
    del old
    want = arr.copy()
    new = share_memory([(base, 8 * PAGE)])
    assert new is not None and new.nbytes == 8 * PAGE
    assert os.fstat(new.fd).st_ino != old_inode
    assert np.array_equal(arr, want)
    assert _backs(new, arr, 0) and _backs(new, arr, 7)
    new.close()
    del arr
    m.close()


def test_a_memfd_stays_in_use_while_a_handout_equal_to_a_collected_one_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine closed but not yet collected (its registrations sit in
    reference cycles) still holds its SharedMemory, descriptor closed. A new
    engine's buffer on the same pages is handed that memfd under the number
    just closed (the kernel gives out the lowest free one), with the same
    spans: an object equal to the old one by value. Once the collector takes
    the old one, the memfd must still count as in use for the new one, or
    its second stage maps a new memfd over the pages its first stage shared,
    whose loads then all vanish (seen: test_pipeline_stages' hybrid test,
    every stage-0 page zero, as the collector happened to run between the
    two stages' registrations)."""
    m, arr = _region(8)
    base = arr.ctypes.data
    old = share_memory([(base, 8 * PAGE)])
    assert old is not None
    # The handover's dup gets old's number: pinned with dup2 (which replaces
    # old's descriptor, to the same memfd, at once), so no other thread can
    # take the number in between as it could after a close.
    real_os, number = host_share.os, old.fd
    monkeypatch.setattr(
        host_share,
        "os",
        SimpleNamespace(
            **{**vars(real_os), "dup": lambda fd: real_os.dup2(fd, number)}
        ),
    )
    stage0 = share_memory([(base, 8 * PAGE)])
    monkeypatch.setattr(host_share, "os", real_os)
    assert stage0 is not None
    assert (stage0.fd, stage0.spans) == (old.fd, old.spans)  # the case at hand
    del old
    gc.collect()
    _second_stage_shares_the_first_ones_memfd(stage0, arr)
    del arr
    m.close()


def _second_stage_shares_the_first_ones_memfd(
    stage0: SharedMemory, arr: np.ndarray
) -> None:
    """A second stage sharing the same pages gets stage0's memfd, which still
    backs them; both are closed after."""
    stage1 = share_memory([(arr.ctypes.data, 8 * PAGE)])
    assert stage1 is not None
    assert os.fstat(stage1.fd).st_ino == os.fstat(stage0.fd).st_ino
    assert _backs(stage0, arr, 0) and _backs(stage0, arr, 7)
    for shared in (stage0, stage1):
        shared.close()
