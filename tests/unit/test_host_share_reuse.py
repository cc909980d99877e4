"""pegaflow.client.host_share's process-wide record of the memfds it mapped
over this process's memory: pages a second caller names again get the same
memfd; pages partly backed by an older memfd (memory freed and reused, still
mapped from it) get a new one, not a refusal (seen: a test buffer from
glibc's heap landing over a freed one's pages; CI's run of test_shared_kv
failed with no share)."""

from __future__ import annotations

import mmap
import os

import numpy as np

from pegaflow.client.host_share import PAGE, share_memory


def _region(pages: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, pages * PAGE)
    arr = np.frombuffer(m, np.uint8)
    arr[:] = np.random.default_rng(pages).integers(0, 256, arr.size, np.uint8)
    return m, arr


def test_the_same_pages_reuse_the_memfd_and_a_partial_overlap_gets_a_new_one() -> None:
    m, arr = _region(16)
    base = arr.ctypes.data
    want = arr.copy()
    first = share_memory([(base, 8 * PAGE)])
    assert first is not None and first.nbytes == 8 * PAGE
    again = share_memory([(base + PAGE, 2 * PAGE)])  # inside the first
    assert again is not None and again.fd != first.fd
    assert os.fstat(again.fd).st_ino == os.fstat(first.fd).st_ino
    assert again.spans[0].offset == PAGE
    later = share_memory([(base + 4 * PAGE, 8 * PAGE)])  # half on the first
    assert later is not None
    assert os.fstat(later.fd).st_ino != os.fstat(first.fd).st_ino
    assert np.array_equal(arr, want)  # every byte where it was
    # The new memfd is what the process reads now: a write through it shows.
    os.pwrite(later.fd, b"\x5a" * 16, 0)
    assert bytes(arr[4 * PAGE : 4 * PAGE + 16]) == b"\x5a" * 16
    for shared in (first, again, later):
        shared.close()
    del arr
    m.close()
