"""pegaflow.common.memfd: the seals the engine's KV file and the kept pool
rely on, and libc's mmap where Python's cannot go (a fixed address)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Iterator

import pytest

from pegaflow.common.memfd import SEALS, map_shared, sealed, unmap

PAGE = mmap.PAGESIZE


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("test-memfd", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 2 * PAGE)
    yield fd
    os.close(fd)


def test_sealed_file_refuses_to_shrink_grow_or_unseal(memfd: int) -> None:
    """Scenario: a memfd of two pages gets SEALS. Neither a shrink nor a
    growth goes through (EPERM: a mapping of it can never SIGBUS), and no
    seal can be added or lifted after; writes inside it still land."""
    assert not sealed(memfd)
    fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, SEALS)
    assert sealed(memfd)
    for size in (PAGE, 4 * PAGE, 0):
        with pytest.raises(OSError) as refused:
            os.ftruncate(memfd, size)
        assert refused.value.errno == errno.EPERM, size
    with pytest.raises(OSError) as refused:
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert refused.value.errno == errno.EPERM
    assert os.fstat(memfd).st_size == 2 * PAGE
    assert os.pwrite(memfd, b"kv", PAGE) == 2


def test_sealed_is_false_for_what_is_not_a_memfd() -> None:
    r, w = os.pipe()
    try:
        assert not sealed(r)
    finally:
        os.close(r)
        os.close(w)


def test_map_shared_anywhere_then_fixed_over_a_page(memfd: int) -> None:
    """Scenario: the file mapped where the kernel chooses, then a second file
    mapped over its second page at that very address (as an engine backs its
    KV): each page shows its own file's bytes, and a write through the fixed
    mapping lands in the second file."""
    os.pwrite(memfd, b"a" * (2 * PAGE), 0)
    other = os.memfd_create("test-memfd-2", os.MFD_CLOEXEC)
    try:
        os.pwrite(other, b"b" * PAGE, 0)
        base = map_shared(memfd, 2 * PAGE)
        try:
            assert map_shared(other, PAGE, 0, at=base + PAGE) == base + PAGE
            assert ctypes.string_at(base, 2 * PAGE) == b"a" * PAGE + b"b" * PAGE
            ctypes.memmove(base + PAGE, b"written", 7)
            assert os.pread(other, 7, 0) == b"written"
            assert os.pread(memfd, 7, PAGE) == b"aaaaaaa"
        finally:
            unmap(base, 2 * PAGE)
    finally:
        os.close(other)


def test_map_shared_refusal_is_an_oserror_with_errno() -> None:
    with pytest.raises(OSError) as refused:
        map_shared(-1, PAGE)
    assert refused.value.errno == errno.EBADF
