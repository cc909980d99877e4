"""Spill and load through SsdTier on the POSIX backend: bytes, files, restarts,
the FIFO ring and the bounded queue."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from pegaflow.common.keys import namespace_digest
from tests.gds.helpers import (
    MODES,
    NS,
    addresses,
    block,
    config,
    key,
    load,
    opened,
    spill,
)


def test_round_trip_every_byte(tmp_path: Path) -> None:
    with opened(config(tmp_path)) as tier:
        assert tier.mode in MODES
        assert spill(tier, list(range(20)), slot_bytes=12345) == 20
        assert load(tier, list(range(20)), slot_bytes=12345).all()
        st = tier.stats()
        assert st.blocks == st.blocks_written == 20 and st.blocks_read == 20
        assert st.bytes_written == st.bytes_read == 20 * 12345
        assert st.loads == 1 and st.load_hits == 20 and st.load_seconds > 0


def test_tp_shards_and_prefix_lookup(tmp_path: Path) -> None:
    with opened(config(tmp_path)) as tier:
        spill(tier, [0, 1, 2, 4], shards=4, slot_bytes=5000)
        assert tier.lookup(NS, [key(i) for i in range(6)]) == 3
        assert tier.lookup(namespace_digest("other"), [key(0)]) == 0
        assert load(tier, [0, 1, 2, 3, 4], shards=4, slot_bytes=5000).tolist() == [
            True,
            True,
            True,
            False,  # never spilled
            True,
        ]
        # another geometry for the same key is a miss, not a partial copy
        assert not load(tier, [0], shards=2, slot_bytes=5000).any()
        assert tier.stats().checksum_failures == 0


def test_many_blocks_across_two_files_survive_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, capacity=32 << 20, files=2)
    ids = list(range(300))
    with opened(cfg) as tier:
        assert spill(tier, ids, slot_bytes=20000) == 300
        files = {r.file for t in tier.store.index.tables.values() for r in t.values()}
        assert files == {0, 1}
        assert spill(tier, ids[:10], slot_bytes=20000) == 0  # already there
        assert tier.stats().spills_skipped == 10
    with opened(cfg) as tier:
        assert tier.store.recovery.blocks == 300
        assert tier.lookup(NS, [key(i) for i in ids]) == 300
        assert load(tier, ids, slot_bytes=20000).all()


def test_fifo_wrap_drops_the_oldest_and_never_returns_overwritten_data(
    tmp_path: Path,
) -> None:
    """4 MiB ring, 36 KiB records: ~113 fit. After 400 spills only the newest are
    there, and every block that loads is its own bytes."""
    # One writer: with two, neighbours may reach the ring in swapped order and
    # the oldest survivor is then not the lowest id (seen: 1 run in ~20).
    cfg = config(tmp_path, capacity=4 << 20, write_threads=1)
    ids = list(range(400))
    with opened(cfg) as tier:
        spill(tier, ids, slot_bytes=32768)
        ok = load(tier, ids, slot_bytes=32768)
        assert not ok[:250].any() and ok[-100:].all()
        survivors = int(ok.sum())
        assert ok[-survivors:].all()  # FIFO: a contiguous run of the newest
        assert tier.stats().checksum_failures == tier.stats().header_mismatches == 0
    with opened(cfg) as tier:  # the replayed ring is the same ring
        assert tier.store.recovery.blocks == survivors
        assert load(tier, ids[-survivors:], slot_bytes=32768).all()
        spill(tier, list(range(400, 450)), slot_bytes=32768)
        ok = load(tier, list(range(450)), slot_bytes=32768)
        assert ok[-50:].all() and int(ok.sum()) == survivors


def test_full_queue_drops_spills_and_counts_them(tmp_path: Path) -> None:
    """One writer, stuck in the first spill's release callback; a queue of 4: the
    next 4 spills queue, the rest drop. Every queued spill is released once."""
    gate = threading.Event()
    released: list[int] = []

    def release(i: int) -> None:
        released.append(i)
        if i == 0:
            gate.wait(10)

    cfg = config(tmp_path, queue_blocks=4, write_threads=1)
    data = [block(i, 1, 8192) for i in range(20)]
    with opened(cfg) as tier:
        results = [
            tier.spill(NS, key(i), addresses(d), 8192, lambda i=i: release(i))
            for i, d in enumerate(data)
        ]
        # the writer may or may not have taken block 0 off the queue yet
        assert results[:4] == [True] * 4 and sum(results) in (4, 5)
        assert tier.stats().spills_dropped == 20 - sum(results)
        gate.set()
        assert tier.flush(timeout=10)
        queued = [i for i, r in enumerate(results) if r]
        assert sorted(released) == queued
        ok = load(tier, list(range(20)), slot_bytes=8192)
        assert ok.tolist() == results


def test_seen_twice_admission(tmp_path: Path) -> None:
    with opened(config(tmp_path, admission="seen_twice")) as tier:
        data = block(7, 1, 4096)
        assert not tier.spill(NS, key(7), addresses(data), 4096)
        assert tier.spill(NS, key(7), addresses(data), 4096)
        tier.flush()
        assert tier.stats().spills_not_admitted == 1
        assert load(tier, [7], slot_bytes=4096).all()


def test_record_larger_than_a_file_is_refused(tmp_path: Path) -> None:
    with opened(config(tmp_path, capacity=2 << 20)) as tier:
        big = np.zeros((1, 3 << 20), np.uint8)
        assert tier.spill(NS, key(1), addresses(big), 3 << 20)
        tier.flush()
        assert tier.stats().no_space == 1 and tier.lookup(NS, [key(1)]) == 0


def test_failed_spill_frees_its_space(tmp_path: Path) -> None:
    """A release callback that raises: the spill fails, is counted, and its ring
    space does not stay busy (later spills wrap past it)."""

    def boom() -> None:
        raise RuntimeError("caller bug")

    with opened(config(tmp_path, capacity=2 << 20)) as tier:
        data = block(0, 1, 8192)
        assert tier.spill(NS, key(0), addresses(data), 8192, boom)
        assert tier.flush(timeout=10)
        assert tier.stats().write_errors == 1 and tier.lookup(NS, [key(0)]) == 0
        spill(tier, list(range(1, 200)), slot_bytes=8192)  # wraps the 2 MiB ring
        assert tier.stats().no_space == 0
        assert load(tier, list(range(190, 200)), slot_bytes=8192).all()


def test_journal_snapshots_online_and_replays(tmp_path: Path) -> None:
    """Past slack x live entries the journal is rewritten while spills go on;
    a restart from it finds exactly the live blocks."""
    # One writer keeps the ring in spill order (see the FIFO test above).
    cfg = config(tmp_path, capacity=2 << 20, journal_slack=2, write_threads=1)
    ids = list(range(4400))
    with opened(cfg) as tier:
        spill(tier, ids, slot_bytes=4096)
        entries = tier.store.journal.entries
        live = tier.store.index.count
        assert entries < 2 * len(ids)  # rewritten at least once
        ok = load(tier, ids, slot_bytes=4096)
        assert int(ok.sum()) == live and ok[-live:].all()
    with opened(cfg) as tier:
        assert tier.store.recovery.blocks == live
        assert load(tier, ids[-live:], slot_bytes=4096).all()
