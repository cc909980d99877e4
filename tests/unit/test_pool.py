from __future__ import annotations

import numpy as np
import pytest

from pegaflow.cache.pool import HostPool, HugepagesUnavailable, _hugepages_free
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.settings import PoolConfig, parse_addr, parse_size


def test_parse_size_units() -> None:
    assert parse_size("512mb") == 512 << 20
    assert parse_size("8GB") == 8 << 30
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("64KiB") == 64 << 10
    assert parse_size("4096") == 4096
    assert parse_size("1tb") == 1 << 40
    for bad in ("", "mb", "-1gb", "1xb", "one"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_parse_addr() -> None:
    assert parse_addr("127.0.0.1:50055") == ("127.0.0.1", 50055)
    assert parse_addr("[::1]:0") == ("::1", 0)
    for bad in ("localhost", "host:port", "h:70000"):
        with pytest.raises(ValueError):
            parse_addr(bad)


def test_slab_classes_share_and_return_slabs() -> None:
    slabs = SlabAllocator(base=1 << 20, size=4 * 65536, slab_bytes=65536)
    a = slabs.allocate((1000, 0), 200)  # 65 per slab -> 4 slabs hold 260
    assert len(a) == 200 and len(set(a.tolist())) == 200
    assert slabs.used_bytes == 200 * 1000
    assert slabs.allocate((4096, 0), 1).size == 0  # no slab left for another class
    slabs.free(a[:65])  # frees one whole slab worth? only if same slab
    slabs.free(a[65:])
    assert slabs.used_bytes == 0 and len(slabs.free_slabs) == 4
    b = slabs.allocate((4096, 0), 64)
    assert len(b) == 64 and slabs.used_bytes == 64 * 4096
    # slots lie inside the region, aligned to their class inside a slab
    off = b - np.uint64(1 << 20)
    assert ((off % np.uint64(65536)) % np.uint64(4096) == 0).all()


def test_a_batch_of_slots_rises_in_address() -> None:
    """Consecutive blocks then sit in consecutive slots: their copies coalesce
    into long iovecs (a save of 256 blocks halved its speed without it)."""
    slabs = SlabAllocator(base=1 << 20, size=4 * 65536, slab_bytes=65536)
    a = slabs.allocate((4096, 0), 20)
    assert (np.diff(a.astype(np.int64)) == 4096).all()
    slabs.free(a[9:4:-1])  # freed in any order
    b = slabs.allocate((4096, 0), 30)  # slab by slab, each run rising
    runs = np.split(b, np.flatnonzero(np.diff(b.astype(np.int64)) != 4096) + 1)
    assert len(runs) <= 3 and sum(map(len, runs)) == 30


def test_skewed_class_keeps_offset_modulo_4k() -> None:
    slabs = SlabAllocator(base=1 << 20, size=4 * 65536, slab_bytes=65536)
    got = slabs.allocate((8192, 64), 20)  # (65536 - 64) // 8192 = 7 per slab
    assert len(got) == 20 and (got % np.uint64(4096) == 64).all()
    assert slabs.slots_per_slab((8192, 64)) == 7
    plain = slabs.allocate((8192, 0), 8)  # the other class takes the last slab
    assert len(plain) == 8 and (plain % np.uint64(4096) == 0).all()
    slabs.free(got)
    slabs.free(plain)
    assert slabs.used_bytes == 0 and len(slabs.free_slabs) == 4


def test_slab_rejects_oversized_slot() -> None:
    slabs = SlabAllocator(0, 1 << 20, 1 << 16)
    with pytest.raises(ValueError, match="does not fit a slab"):
        slabs.allocate(((1 << 16) + 1, 0), 1)


def test_pool_bring_up_and_views() -> None:
    pool = HostPool(PoolConfig(size_bytes=8 << 20, show_progress=False))
    try:
        assert pool.size == 8 << 20
        assert pool.bring_up.bytes == pool.size
        slot = int(pool.slabs.allocate((4096, 0), 1)[0])
        pool.view(slot, 4096)[:] = 7
        assert pool.view(slot, 4096).sum() == 7 * 4096
        with pytest.raises(ValueError):
            pool.view(pool.base + pool.size, 1)
    finally:
        pool.close()


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def register(self, address: int, size: int) -> None:
        self.calls.append(("register", address, size))

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address, 0))


def test_registrar_seam_called_once_each_way() -> None:
    rec = _Recorder()
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False), rec)
    pool.close()
    assert rec.calls == [
        ("register", pool.base, pool.size),
        ("unregister", pool.base, 0),
    ]


@pytest.mark.skipif(_hugepages_free() > 0, reason="machine has hugepages reserved")
def test_hugepages_missing_is_a_clear_error() -> None:
    with pytest.raises(HugepagesUnavailable, match="nr_hugepages"):
        HostPool(
            PoolConfig(size_bytes=8 << 20, use_hugepages=True, show_progress=False)
        )
