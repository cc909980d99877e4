"""SsdTier.spill_many: a save's sealed blocks cross to the writers as one job
and come back as one release per written slice, not one per block (per-block
handoffs were what the tier's presence cost saves)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .helpers import NS, addresses, block, config, key, load, opened, page_aligned


def test_one_job_is_cut_to_the_room_left_and_released_per_slice(
    tmp_path: Path,
) -> None:
    """Scenario: a queue of 8 blocks, one writer held in its first release;
    spill_many of 20 blocks queues the first 8 (the other 12 dropped, counted),
    a second call while the writer is stuck queues what room is left and skips
    keys already queued. Every queued block is released exactly once, in fewer
    calls than blocks, and reads back byte-equal; the dropped ones miss."""
    gate = threading.Event()
    ranges: list[tuple[int, int, int]] = []  # (call, lo, hi)

    def release(call: int, lo: int, hi: int) -> None:
        ranges.append((call, lo, hi))
        gate.wait(10)

    data = [page_aligned(block(i, 2, 8192)) for i in range(24)]
    table = np.array([addresses(d) for d in data], np.uint64)
    hashes = [key(i) for i in range(24)]
    cfg = config(tmp_path, queue_blocks=8, write_threads=1)
    with opened(cfg) as tier:
        first = tier.spill_many(
            NS, hashes[:20], table[:20], 8192, lambda a, b: release(0, a, b)
        )
        assert first == list(range(8))
        assert tier.stats().spills_dropped == 12
        # blocks 0..7 again (queued: skipped) and 20..23 (fresh)
        again = [*hashes[:8], *hashes[20:]]
        rows = np.concatenate([table[:8], table[20:]])
        second = tier.spill_many(NS, again, rows, 8192, lambda a, b: release(1, a, b))
        assert tier.stats().spills_skipped == 8
        # the writer may or may not have taken the first job off the queue yet
        assert second in ([], [8, 9, 10, 11])
        gate.set()
        assert tier.flush(timeout=10)
        done = {0: [0] * 8, 1: [0] * len(second)}
        for call, lo, hi in ranges:
            for i in range(lo, hi):
                done[call][i] += 1
        assert done == {0: [1] * 8, 1: [1] * len(second)}
        assert len(ranges) < 8 + len(second)
        written = list(range(8)) + [20 + i - 8 for i in second]
        ok = load(tier, list(range(24)), shards=2, slot_bytes=8192)
        assert np.flatnonzero(ok).tolist() == written


def test_a_full_queue_refuses_with_the_counts_a_spill_would_give(
    tmp_path: Path,
) -> None:
    """Scenario: a queue of 4 blocks; the writer takes blocks 0..3 and is held
    in their release, and blocks 4..7 fill the queue. queue_room() says 0, and
    refuse_many of 2 queued and 3 fresh blocks counts what spill_many would
    have (2 skipped, 3 dropped) without a slot table and queues nothing."""
    gate = threading.Event()
    data = [page_aligned(block(i, 1, 8192)) for i in range(8)]
    table = np.array([addresses(d) for d in data], np.uint64)
    hashes = [key(i) for i in range(8)]
    with opened(config(tmp_path, queue_blocks=4, write_threads=1)) as tier:
        assert tier.spill_many(
            NS, hashes[:4], table[:4], 8192, lambda a, b: gate.wait(10)
        )
        _until(lambda: tier.queue_room() == 4)  # the writer took them
        assert tier.spill_many(NS, hashes[4:], table[4:], 8192) == [0, 1, 2, 3]
        assert tier.queue_room() == 0
        before = tier.stats()
        tier.refuse_many(NS, [hashes[1], hashes[5], key(20), key(21), key(22)])
        after = tier.stats()
        assert after.spills_skipped - before.spills_skipped == 2
        assert after.spills_dropped - before.spills_dropped == 3
        assert after.spills_queued == before.spills_queued == 8
        gate.set()
        assert tier.flush(timeout=10)
        ok = load(tier, [*range(8), 20], shards=1, slot_bytes=8192)
        assert ok.tolist() == [True] * 8 + [False]


def test_a_refused_first_sighting_counts_for_seen_twice(tmp_path: Path) -> None:
    """Under seen_twice admission, a block refused at a full queue was still
    seen: offered again, it is admitted and written (as after spill_many)."""
    data = [page_aligned(block(i, 1, 8192)) for i in range(2)]
    table = np.array([addresses(d) for d in data], np.uint64)
    hashes = [key(i) for i in range(2)]
    with opened(config(tmp_path, admission="seen_twice")) as tier:
        tier.refuse_many(NS, hashes)
        assert tier.stats().spills_not_admitted == 2
        assert tier.stats().spills_dropped == 0
        assert tier.spill_many(NS, hashes, table, 8192) == [0, 1]
        assert tier.flush(timeout=10)
        assert load(tier, [0, 1], shards=1, slot_bytes=8192).all()


def _until(done: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_spills_refused_for_space_are_counted_per_block(tmp_path: Path) -> None:
    """A load in flight pins the ring's oldest record, the next space to
    reuse: a batch of 40 spills is refused. no_space counted the refused
    reservation once, so queued != written + no_space (what an operator and
    the server tests add up); it counts the 40 blocks."""
    slot = 16384
    with opened(config(tmp_path, capacity=1 << 20, queue_blocks=64)) as tier:
        ring = tier.store.rings[0]
        fits = (ring.end - ring.start) // (4096 + slot)
        rng = np.random.default_rng(0)
        data = page_aligned(rng.integers(0, 256, (fits + 40, slot), np.uint8))

        def spill_range(lo: int, hi: int) -> None:
            where = np.array(addresses(data[lo:hi]), np.uint64)[:, None]
            tier.spill_many(NS, [key(i) for i in range(lo, hi)], where, slot)
            assert tier.flush(10)

        for lo in range(0, fits, 32):  # the ring full, once around
            spill_range(lo, min(fits, lo + 32))
        pinned = tier.store.pin(NS, ring.records[0].block_hash)
        assert pinned is not None
        before = tier.stats()
        try:
            spill_range(fits, fits + 40)
        finally:
            tier.store.unpin([pinned])
        after = tier.stats()
        queued = after.spills_queued - before.spills_queued
        written = after.blocks_written - before.blocks_written
        assert (queued, written) == (40, 0)
        assert after.no_space - before.no_space == 40
