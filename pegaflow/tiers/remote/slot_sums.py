"""Checksums of pool slots for the remote tier: xxh3-64 of each slot's bytes,
a large batch split over a few threads.

A fetch reads its blocks one-sided and then hashes what landed; on one thread
that hashing ran at ~6.5 GB/s over freshly written memory on the H200 host
(a 64 MiB fetch: ~10 ms after a ~19 ms transfer, benchmarks/RESULTS.md), so
it, not the wire, kept the fetch under the goal. The one-shot xxh3 call drops
the GIL, so threads hashing disjoint slots run in parallel; the caller's own
thread takes the first share, so a small batch never pays a thread hop.

The checksum guards against torn or stale reads (a slot reused under a read,
a peer dying mid-write), not against a peer that lies about the bytes, which
no checksum it computes itself can catch. What a peer serves is bound to the
key it was asked for (`bound`): the checksum a peer sends and the one a
reader compares it with is xxh3-64 over (namespace digest, block hash, shard,
the slot's xxh3-64), the reader filling in the key it asked for, so another
block's bytes with that block's true checksum, answered under the asked
hash (a confused or lying peer), fail the comparison instead of being
published under the wrong key. 24.6 GB/s a core on the dev VM against blake3's
3.6: a 1 GiB fetch hashed on both sides costs 85 ms instead of 600.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pegaflow.cache.pool import HostPool
from pegaflow.common import checksum_rows
from pegaflow.common.checksums import xxh3_64

# Below this many bytes a share is not worth a thread hop (~20-50 us).
MIN_SHARE_BYTES = 8 << 20
# Memory bandwidth, not cores, bounds hashing beyond a few threads, and the
# copy threads and the transfer engine's threads need cores too.
MAX_THREADS = 8


def slot_checksum(data: np.ndarray) -> int:
    return xxh3_64(data)  # drops the GIL: the threads below hash in parallel


def bound(digest: bytes, hashes: Sequence[bytes], raw: np.ndarray) -> np.ndarray:
    """The slots' checksums ([blocks, shards] uint64 xxh3-64 of their bytes)
    bound to their keys: per slot, xxh3-64 of digest || hash || shard (u32
    LE) || the raw checksum (u64 LE); every hash one length. One compiled
    call over rows laid out in numpy, no step per block."""
    blocks, shards = raw.shape
    if blocks != len(hashes):
        raise ValueError(f"hashes: {len(hashes)} for {blocks} blocks")
    if not blocks:
        return raw.astype(np.uint64)
    hash_len = len(hashes[0])
    joined = b"".join(hashes)
    if len(joined) != hash_len * blocks:
        raise ValueError("hashes: need one length")
    d, width = len(digest), len(digest) + hash_len + 12
    rows = np.empty((blocks, shards, width), np.uint8)
    rows[..., :d] = np.frombuffer(digest, np.uint8)
    keys = np.frombuffer(joined, np.uint8).reshape(blocks, 1, hash_len)
    rows[..., d : d + hash_len] = keys
    shard = np.arange(shards, dtype="<u4").view(np.uint8).reshape(1, shards, 4)
    rows[..., d + hash_len : d + hash_len + 4] = shard
    sums = np.ascontiguousarray(raw, "<u8").view(np.uint8).reshape(blocks, shards, 8)
    rows[..., d + hash_len + 4 :] = sums
    addrs = rows.ctypes.data + width * np.arange(blocks * shards, dtype=np.uint64)
    return checksum_rows.rows(addrs[:, None], width).reshape(blocks, shards)


def default_threads() -> int:
    """Half the cores this process may run on, 1..MAX_THREADS."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) // 2))


class SlotHasher:
    """Thread-safe; `close` ends its threads."""

    def __init__(
        self, threads: int | None = None, min_share_bytes: int = MIN_SHARE_BYTES
    ) -> None:
        self.threads = default_threads() if threads is None else max(1, threads)
        self._min_share_bytes = max(1, min_share_bytes)
        self._helpers = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix="slot-hash")
            if self.threads > 1
            else None
        )

    def checksums(
        self, pool: HostPool, slots: np.ndarray, slot_bytes: int
    ) -> np.ndarray:
        """xxh3-64 of each slot at the pool addresses `slots` (uint64, any
        shape), `slot_bytes` each; same shape."""
        flat = slots.reshape(-1).tolist()
        per_share = max(1, self._min_share_bytes // max(1, slot_bytes))
        shares = max(1, min(self.threads, len(flat) // per_share))
        if shares == 1 or self._helpers is None:
            return _hash_run(pool, flat, slot_bytes).reshape(slots.shape)
        cuts = np.linspace(0, len(flat), shares + 1).astype(int).tolist()
        try:
            later = [
                self._helpers.submit(_hash_run, pool, flat[a:b], slot_bytes)
                for a, b in zip(cuts[1:-1], cuts[2:], strict=True)
            ]
        except RuntimeError:  # closed meanwhile (the server stops): hash here
            return _hash_run(pool, flat, slot_bytes).reshape(slots.shape)
        first = _hash_run(pool, flat[cuts[0] : cuts[1]], slot_bytes)
        return np.concatenate([first, *(f.result() for f in later)]).reshape(
            slots.shape
        )

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)


def _hash_run(pool: HostPool, offsets: list[int], slot_bytes: int) -> np.ndarray:
    # One call per slot, each over a whole slot (MiBs), the GIL released inside.
    return np.fromiter(
        (slot_checksum(pool.view(a, slot_bytes)) for a in offsets),
        np.uint64,
        len(offsets),
    )
