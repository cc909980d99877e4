"""The remote tier's slot checksums: split over threads they are the same as
one xxh3-64 per slot, in the slots' order and shape."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from pegaflow.cache.pool import HostPool, PoolConfig
from pegaflow.tiers.remote.slot_sums import SlotHasher


@pytest.fixture
def pool():
    p = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    p.array[:] = np.random.default_rng(7).integers(0, 256, p.size, np.uint8)
    yield p
    p.close()


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_split_checksums_equal_one_hash_per_slot(pool, threads: int) -> None:
    slot = 4096
    rng = np.random.default_rng(threads)
    picked = rng.choice(pool.size // slot, 60, replace=False)
    slots = (pool.base + picked * slot).astype(np.uint64).reshape(20, 3)
    want = np.array(
        [xxhash.xxh3_64_intdigest(pool.view(int(a), slot)) for a in slots.ravel()],
        np.uint64,
    ).reshape(20, 3)
    hasher = SlotHasher(threads, min_share_bytes=slot)  # every share worth a thread
    try:
        got = hasher.checksums(pool, slots, slot)
    finally:
        hasher.close()
    assert got.shape == (20, 3) and got.dtype == np.uint64
    np.testing.assert_array_equal(got, want)


def test_a_closed_hasher_still_answers(pool) -> None:
    hasher = SlotHasher(4, min_share_bytes=1)
    hasher.close()
    slots = np.array([pool.base, pool.base + 8192], np.uint64)
    got = hasher.checksums(pool, slots, 4096)
    assert got.tolist() == [
        xxhash.xxh3_64_intdigest(pool.view(int(a), 4096)) for a in slots
    ]
