"""Slot rows of a file-backed pool, in process: what a save in flight, a
published block and a freed slot leave in the file, and what a restart
rebuilds from it (pegaflow.cache.slot_log, pegaflow.server.warm_restart)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import LRUPolicy
from pegaflow.cache.instances import Registry
from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import FREE, LANDED, META_OFFSET, SEALED, WRITING
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.cache.slot_log import checksums
from pegaflow.common.keys import Namespace
from pegaflow.common.settings import PoolConfig
from pegaflow.server.warm_restart import Recovered, recover
from tests.keeper_tools import free

SLOT = 16 << 10
POOL = 4 << 20  # slabs of 256 KiB: 16 slots each, 256 slots in all
SLAB = 256 << 10


@pytest.fixture(autouse=True)
def _free_keepers(tmp_path: Path) -> Iterator[None]:
    """Each pool's keeper stopped (`rm PATH`) when its test ends."""
    yield
    for p in tmp_path.iterdir():
        free(p)


def _pool(path: Path) -> HostPool:
    cfg = PoolConfig(POOL, prefault_threads=1, show_progress=False, pool_file=str(path))
    return HostPool(cfg)


def _ns(ident: int = 1) -> Namespace:
    return Namespace("ns", ident, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))


def _states(pool: HostPool, store: BlockStore, hashes: list[bytes]) -> list[int]:
    t = pool.file.table
    rows = [(store.entries[(1, h)].slots[0] - pool.base) // 4096 for h in hashes]
    return t["state"][rows].tolist()


def _restart(path: Path) -> tuple[HostPool, BlockStore, Registry, object]:
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    registry = Registry({})
    recovered = Recovered(registry)
    report = recover(pool, store, recovered)
    return pool, store, registry, report


def test_save_in_flight_is_writing_then_landed_then_sealed(tmp_path: Path) -> None:
    """Scenario: a save reserves 8 blocks (rows WRITING while the copy runs),
    the pool closes before it finishes (as a SIGKILL mid-copy would leave the
    file): the restarted pool recovers none of them and reports 8 torn.
    Saved and finished, they are LANDED at once and SEALED once the sealer
    drains; a restart then recovers all 8, byte-equal."""
    path = tmp_path / "pool.bin"
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    ns, hashes = _ns(), [bytes([i]) * 16 for i in range(8)]
    res = store.reserve_save(ns, 0, hashes, np.arange(2))
    assert _states(pool, store, hashes) == [WRITING] * 8
    pool.close()
    pool, store, _, report = _restart(path)
    assert (report.blocks, report.torn) == (0, 8)
    assert pool.slabs.used_bytes == 0
    assert (pool.file.table["state"] != FREE).sum() == 0

    res = store.reserve_save(ns, 0, hashes, np.arange(2))
    want = np.random.default_rng(0).integers(0, 256, (8, SLOT), dtype=np.uint8)
    for slot, data in zip(res.slots.tolist(), want, strict=True):
        pool.view(slot, SLOT)[:] = data
    store.finish_save(res, True)
    assert set(_states(pool, store, hashes)) <= {LANDED, SEALED}
    assert pool.log.drain(30)
    assert _states(pool, store, hashes) == [SEALED] * 8
    pool.close()
    pool, store, registry, report = _restart(path)
    assert (report.blocks, report.torn, report.bad_checksum) == (8, 0, 0)
    (ns,) = registry.namespaces.values()  # known by digest until adopted
    found = store.longest_prefix(ns, hashes)
    assert len(found) == 8
    for entry, data in zip(found, want, strict=True):
        assert np.array_equal(pool.view(entry.slots[0], SLOT), data)
    pool.close()


def test_recovered_blocks_are_counted_and_evictable(tmp_path: Path) -> None:
    """Scenario: a full pool of 256 blocks is kept across a restart; the
    recovered blocks count as used and resident, and a new namespace's save
    of 16 blocks evicts 16 of them (LRU) instead of failing; the evicted
    slots' rows are FREE, then WRITING/LANDED for the new blocks."""
    path = tmp_path / "pool.bin"
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    old = [i.to_bytes(4, "little") for i in range(256)]
    store.finish_save(store.reserve_save(_ns(), 0, old, np.arange(2)), True)
    assert pool.slabs.used_bytes == POOL
    pool.close()
    pool, store, _, report = _restart(path)
    assert report.blocks == 256 and store.resident_ready == 256
    assert pool.slabs.used_bytes == POOL
    other = Namespace("other", 99, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
    new = [b"new" + bytes([i]) for i in range(16)]
    res = store.reserve_save(other, 0, new, np.arange(2))
    assert len(res.keys) == 16 and store.counters.evictions == 16
    store.finish_save(res, True)
    assert store.resident_ready == 256 and pool.slabs.used_bytes == POOL
    states = pool.file.table["state"]
    assert ((states == LANDED) | (states == SEALED)).sum() == 256
    pool.close()


def test_two_namespaces_sharing_slabs_keep_every_slot_across_a_restart(
    tmp_path: Path,
) -> None:
    """Scenario: namespaces A and B of one slot size (two tenants of a model)
    hold 4 blocks each in the same slab; after a restart a third namespace's
    save gets only free slots, never one that a recovered block still holds,
    and every recovered block keeps its bytes."""
    path = tmp_path / "pool.bin"
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    spaces = [Namespace(n, i, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
              for i, n in enumerate("ABC", 1)]  # fmt: skip
    for ns, fill in zip(spaces[:2], (0xAA, 0xBB), strict=True):
        res = store.reserve_save(ns, 0, [ns.name.encode() + bytes([i]) for i in
                                         range(4)], np.arange(2))  # fmt: skip
        for slot in res.slots.tolist():
            pool.view(slot, SLOT)[:] = fill
        store.finish_save(res, True)
    assert pool.log.drain(30)
    pool.close()
    pool, store, _, report = _restart(path)
    assert report.blocks == 8 and pool.slabs.used_bytes == 8 * SLOT
    held = {e.slots[0]: bytes(pool.view(e.slots[0], SLOT)) for e in
            store.entries.values()}  # fmt: skip
    assert len(held) == 8
    res = store.reserve_save(spaces[2], 0, [b"C" + bytes([i]) for i in range(4)],
                             np.arange(2))  # fmt: skip
    assert not set(res.slots.tolist()) & set(held) and store.counters.evictions == 0
    for slot in res.slots.tolist():
        pool.view(slot, SLOT)[:] = 0xCC
    store.finish_save(res, True)
    assert all(bytes(pool.view(a, SLOT)) == b for a, b in held.items())
    victims = store.reserve_save(spaces[2], 0, [b"D" + bytes([i]) for i in
                                                range(250)], np.arange(2))  # fmt: skip
    assert store.counters.evictions > 0  # evicting recovered blocks works
    store.finish_save(victims, True)
    pool.close()


def test_claims_of_one_slab_across_calls_never_give_a_slot_twice() -> None:
    """SlabAllocator.claim called once per namespace group: a slot an earlier
    call took is refused, another class in the slab is refused, an empty
    claim leaves the slab free, and a later allocation gets only free slots."""
    slabs = SlabAllocator(1 << 30, 4 * SLAB, SLAB)
    assert slabs.claim([1 << 30, (1 << 30) + 4096], 4096) == [True, True]
    assert slabs.claim([(1 << 30) + 4096, (1 << 30) + 8192], 4096) == [False, True]
    assert slabs.claim([(1 << 30) + 12288], 8192) == [False]  # another class
    assert slabs.claim([(1 << 30) + SLAB + 100], 8192) == [True]  # skew 100
    assert slabs.claim([(1 << 30) + 5 * SLAB, (1 << 30) - 4096], 4096) == [False] * 2
    assert len(slabs.free_slabs) == 2 and slabs.used_bytes == 3 * 4096 + 8192
    got = slabs.allocate((4096, 0), SLAB // 4096)
    assert not {(1 << 30) + i * 4096 for i in range(3)} & set(got.tolist())
    assert len(got) == SLAB // 4096  # the slab's rest, then a fresh slab
    slabs.free(np.array([1 << 30], np.uint64))  # a claimed slot frees as any
    assert slabs.used_bytes == 3 * 4096 + 8192 + (SLAB // 4096 - 1) * 4096


def _sealed(path: Path, hashes: list[bytes]) -> tuple[np.ndarray, list[int]]:
    """A pool file holding these blocks (random bytes), every slot SEALED;
    their bytes and rows."""
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    res = store.reserve_save(_ns(), 0, hashes, np.arange(2))
    want = np.random.default_rng(1).integers(0, 256, (len(hashes), SLOT), np.uint8)
    for slot, data in zip(res.slots.tolist(), want, strict=True):
        pool.view(slot, SLOT)[:] = data
    store.finish_save(res, True)
    assert pool.log.drain(30)
    rows = [(s - pool.base) // 4096 for s in res.slots.tolist()]
    pool.close()
    return want, rows


def test_the_checksum_is_xxh3_64_of_the_row_meta_and_the_slot(tmp_path: Path) -> None:
    """Scenario: the algorithm is part of the file format (pool format 2): a
    sealed row's checksum is xxh3-64 over its bytes from META_OFFSET on, then
    the slot's bytes, and the batched form gives the same per row."""
    want, rows = _sealed(tmp_path / "pool.bin", [bytes([i]) * 16 for i in range(4)])
    pool = _pool(tmp_path / "pool.bin")
    t, data = pool.file.table, pool.file.data
    raw = t.view(np.uint8).reshape(len(t), -1)
    for row, block in zip(rows, want, strict=True):
        meta = raw[row, META_OFFSET:].tobytes()
        expect = xxhash.xxh3_64_intdigest(meta + block.tobytes())
        assert int(t["checksum"][row]) == expect
    assert checksums(t, data, np.asarray(rows)).tolist() == t["checksum"][rows].tolist()
    pool.close()


def test_a_row_whose_slot_lies_outside_the_pool_is_refused(tmp_path: Path) -> None:
    """Scenario: the batched checksum reads slots by address, so a row's
    offset and size (the file's claim) are checked against the pool's data
    first: a row past the end, or one whose size would wrap the sum, is
    refused naming the row, and nothing is read."""
    _, rows = _sealed(tmp_path / "pool.bin", [bytes([i]) * 16 for i in range(2)])
    pool = _pool(tmp_path / "pool.bin")
    t, data = pool.file.table, pool.file.data
    for field, value in (("offset", data.nbytes), ("slot_bytes", 2**64 - 1)):
        copy = t.copy()
        copy[field][rows[1]] = value
        with pytest.raises(ValueError, match=f"pool row {rows[1]}: its slot lies"):
            checksums(copy, data, np.asarray(rows))
    assert checksums(t, data, np.asarray([], np.intp)).size == 0
    pool.close()


def test_a_damaged_slot_or_row_fails_its_checksum_and_is_dropped(
    tmp_path: Path,
) -> None:
    """Scenario: 8 blocks sealed; while no server runs, one byte of block 3's
    slot and one byte of block 5's namespace digest (in its row) are flipped:
    the restart drops both for their checksum, recovers the other 6 byte-equal,
    and frees the two rows."""
    path = tmp_path / "pool.bin"
    hashes = [bytes([i]) * 16 for i in range(8)]
    want, rows = _sealed(path, hashes)
    pool = _pool(path)
    t = pool.file.table
    pool.file.data[int(t["offset"][rows[3]]) + 4321] ^= 0x01
    t["digest"][rows[5], 7] ^= 0x80
    pool.close()
    pool, store, registry, report = _restart(path)
    assert (report.blocks, report.bad_checksum, report.torn) == (6, 2, 0)
    # the damaged digest named a namespace of its own, left empty
    (ns,) = [n for n in registry.namespaces.values() if store.holds(n.id)]
    for i, h in enumerate(hashes):
        found = store.longest_prefix(ns, [h])
        assert len(found) == (i not in (3, 5)), i
        if found:
            assert np.array_equal(pool.view(found[0].slots[0], SLOT), want[i])
    assert pool.file.table["state"][[rows[3], rows[5]]].tolist() == [FREE, FREE]
    pool.close()


def test_a_damaged_state_word_drops_its_row_and_never_skips_a_check(
    tmp_path: Path,
) -> None:
    """Scenario (a review's, against format 2's one-bit-apart states): while
    no server runs, one byte of block 3's slot and one bit of its row's
    state word flip (SEALED read as LANDED would skip the checksum and
    serve the damaged byte); block 6's slot was freed (its row FREE, its
    fields stale) and one bit of that state flips (FREE read as LANDED would
    serve the freed slot as block 6). Neither is served: both rows hold no
    known state, are counted and dropped; the other 6 come back byte-equal."""
    path = tmp_path / "pool.bin"
    hashes = [bytes([i]) * 16 for i in range(8)]
    want, rows = _sealed(path, hashes)
    pool = _pool(path)
    t = pool.file.table
    pool.file.data[int(t["offset"][rows[3]]) + 99] ^= 0x01
    t["state"][rows[6]] = FREE
    for row in (rows[3], rows[6]):
        for bit in range(32):  # the first flip not read as FREE or WRITING
            if t["state"][row] ^ (1 << bit) not in (FREE, WRITING):
                t["state"][row] ^= 1 << bit
                break
    pool.close()
    pool, store, registry, report = _restart(path)
    assert (report.blocks, report.damaged, report.bad_checksum) == (6, 2, 0)
    (ns,) = registry.namespaces.values()
    for i, h in enumerate(hashes):
        found = store.longest_prefix(ns, [h])
        assert len(found) == (i not in (3, 6)), i
        if found:
            assert np.array_equal(pool.view(found[0].slots[0], SLOT), want[i])
    assert pool.file.table["state"][[rows[3], rows[6]]].tolist() == [FREE, FREE]
    pool.close()


def test_rows_a_restart_kept_unsealed_are_sealed_for_the_next(
    tmp_path: Path,
) -> None:
    """Scenario: the last server stopped before its sealer hashed 8 blocks
    (rows LANDED, trusted without a checksum); the restart serves them at
    once and seals them, so the restart after it checks them: a byte of
    block 2 changed between the two is caught."""
    path = tmp_path / "pool.bin"
    hashes = [bytes([i]) * 16 for i in range(8)]
    want, rows = _sealed(path, hashes)
    pool = _pool(path)
    pool.file.table["state"][rows] = LANDED
    pool.close()
    pool, store, _, report = _restart(path)
    assert (report.blocks, report.unsealed) == (8, 8)
    assert pool.log.drain(30)
    assert pool.file.table["state"][rows].tolist() == [SEALED] * 8
    pool.file.data[int(pool.file.table["offset"][rows[2]]) + 7] ^= 0x10
    pool.close()
    pool, store, _, report = _restart(path)
    assert (report.blocks, report.bad_checksum) == (7, 1)
    pool.close()


def test_a_file_pool_opens_without_waiting_for_the_checksum_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sealer's compiled checksum loop (numba: ~1 s of a restart's ~1.6 s
    to READY on the dev VM) is compiled beside the serving server: the pool
    opens while the compile still runs, and seals meanwhile through
    python-xxhash."""
    import threading

    from pegaflow.common import checksum_rows

    release = threading.Event()

    def slow_compile() -> None:  # stands in for numba, until released
        release.wait(60)
        return None

    monkeypatch.setattr(checksum_rows, "_native", slow_compile)
    monkeypatch.setattr(checksum_rows, "_warmed", threading.Event())
    monkeypatch.setattr(checksum_rows, "_warming", None)
    opened: list[HostPool] = []
    opener = threading.Thread(target=lambda: opened.append(_pool(tmp_path / "p")))
    opener.start()
    opener.join(30)
    try:
        assert opened, "the pool waited for the checksum loop's compile"
        assert not checksum_rows._warmed.is_set()
        data = np.random.default_rng(3).integers(0, 256, 3 * SLOT, np.uint8)
        want = [
            xxhash.xxh3_64_intdigest(data[i * SLOT : (i + 1) * SLOT]) for i in range(3)
        ]
        addrs = data.ctypes.data + np.arange(3, dtype=np.uint64)[:, None] * SLOT
        assert checksum_rows.rows(addrs, SLOT).tolist() == want
    finally:
        release.set()
        opener.join(30)
        for pool in opened:
            pool.close()


def _kept_pool(tmp_path: Path, n: int = 8) -> tuple[HostPool, object]:
    """A pool file of n saved blocks, reopened: the pool and its check."""
    from pegaflow.server.warm_restart import find

    path = tmp_path / "pool.bin"
    pool = _pool(path)
    store = BlockStore(pool.slabs, LRUPolicy())
    hashes = [i.to_bytes(4, "little") for i in range(n)]
    store.finish_save(store.reserve_save(_ns(), 0, hashes, np.arange(2)), True)
    assert pool.log.drain(30)
    pool.close()
    pool = _pool(path)
    check = find(pool, BlockStore(pool.slabs, LRUPolicy()), Recovered(Registry({})))
    assert check is not None
    return pool, check


def test_a_checks_callbacks_run_once_every_kept_block_was_checked(
    tmp_path: Path,
) -> None:
    """PoolCheck.when_done: the server lets the rest of the pool pin for the
    GPUs only once the restart's check is over; a callback given after that
    runs at once."""
    pool, check = _kept_pool(tmp_path)
    calls: list[str] = []
    check.when_done(lambda: calls.append("early"))
    assert calls == []
    check.run_here()
    assert calls == ["early"] and check.outcome.unchecked == 0
    check.when_done(lambda: calls.append("late"))
    assert calls == ["early", "late"]
    pool.close()


def test_a_recovered_namespace_keeps_its_digest_through_adoption() -> None:
    """Tiers cache a namespace's digest by id (the remote link advertises and
    asks peers by it). A placeholder's digest was once computed from its
    placeholder name, and stayed cached after an engine's namespace adopted
    it: peers asked with the real digest and never found its blocks."""
    from pegaflow.common.keys import namespace_digest
    from pegaflow.tiers.remote.link import RemoteLink

    registry = Registry({})
    recovered = Recovered(registry)
    real = Namespace("ns", 0, 1, 2, 16384, (2, 8192, 8192))
    digest = namespace_digest(real.name, real.signature)
    placeholder = recovered.placeholder(digest, 1, 2, 16384)
    assert placeholder.digest == digest
    link = RemoteLink.__new__(RemoteLink)  # its digest cache alone
    link._digests, link.namespaces = {}, {}
    assert RemoteLink.digest(link, placeholder) == digest  # before any engine
    adopted = recovered.adopt(Namespace("ns", 9, 1, 2, 16384, real.signature))
    assert adopted is placeholder and adopted.name == "ns"
    assert adopted.digest == digest
    assert RemoteLink.digest(link, adopted) == digest
    assert link.namespaces[digest] is adopted


def test_a_batch_whose_check_fails_is_dropped_and_the_check_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception while checking one batch ended the check thread: the
    batch it had taken stayed pinned and `loading` for good, and the check
    (and the pinning it holds back) never ended. Now that batch's blocks are
    dropped (never served unchecked) and the rest are checked."""
    from pegaflow.server import pool_check

    pool, check = _kept_pool(tmp_path)
    monkeypatch.setattr(check, "_batch", 1)  # a block a batch
    real, calls = pool_check.checksums, []

    def fails_once(*args: object) -> np.ndarray:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("a read of the pool failed")
        return real(*args)

    monkeypatch.setattr(pool_check, "checksums", fails_once)
    done: list[bool] = []
    check.when_done(lambda: done.append(True))
    check.run_here()
    assert done == [True] and check.outcome.unchecked == 0
    assert check.outcome.bad_checksum == 1 and check.outcome.blocks == 7
    pool.close()


class _NoWalks(dict):
    """The store's unchecked set, refusing to be walked: an eviction that
    walks it from the front steps over every key removed before (a dict
    keeps their slots), ~1 ms a save at 1M blocks mid-check (a review's
    measurement); victims come off a stack instead."""

    def _walk(self, *args: object) -> None:
        raise AssertionError("the unchecked set was walked")

    __iter__ = items = keys = values = _walk  # type: ignore[assignment]


def test_an_eviction_of_unchecked_blocks_never_walks_their_set(
    tmp_path: Path,
) -> None:
    pool, check = _kept_pool(tmp_path, 256)
    store = check._store
    store.add_listener(check)
    store.unchecked = _NoWalks(store.unchecked)
    other = Namespace("other", 99, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
    for i in range(32):  # one block a save: 32 evictions
        res = store.reserve_save(other, 0, [b"w" + bytes([i])], np.arange(2))
        assert len(res.keys) == 1
        store.finish_save(res, True)
    assert store.counters.evictions == 32 and check.outcome.unchecked == 224
    pool.close()


def test_unchecked_blocks_make_room_and_a_check_of_an_evicted_one_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: a full pool (256 blocks) is kept; after the restart none is
    checked yet, and the check has taken the first block. A new namespace's
    save of 16 blocks evicts 16 unchecked blocks instead of being refused
    `pool_full`: the last adopted, which the check reaches last. A save of
    240 more evicts the rest, the first block among them; its check, ending
    after its slot took new bytes, is dropped (not a bad checksum, the new
    block untouched), and the check is over with every new block served."""
    pool, check = _kept_pool(tmp_path, 256)
    store = check._store
    store.add_listener(check)  # as the server adds its tiers
    monkeypatch.setattr(check, "_batch", 1)  # a block a batch
    kept = [e.key for e in check._p.entries]
    first = check._next()
    assert first is not None and first.tolist() == [0]
    other = Namespace("other", 99, 1, 2, SLOT, (2, SLOT // 2, SLOT // 2))
    new = [b"new" + i.to_bytes(2, "little") for i in range(256)]
    rng = np.random.default_rng(5)
    want = rng.integers(0, 256, (256, SLOT), dtype=np.uint8)
    for part in (slice(0, 16), slice(16, 256)):
        res = store.reserve_save(other, 0, new[part], np.arange(2))
        assert (len(res.keys), res.rejected) == (len(new[part]), 0)
        for slot, data in zip(res.slots.tolist(), want[part], strict=True):
            pool.view(slot, SLOT)[:] = data
        store.finish_save(res, True)
        if part.start == 0:
            assert store.counters.evictions == 16 and check.outcome.unchecked == 240
            assert [k in store.entries for k in kept[-17:]] == [True] + [False] * 16
            assert kept[0] in store.unchecked
    assert store.counters.evictions == 256 and check.outcome.unchecked == 0
    check._publish(first, check._check(first))
    assert check.outcome.bad_checksum == 0
    assert check.outcome.check_seconds is not None
    found = store.longest_prefix(other, new)
    assert len(found) == 256
    for entry, data in zip(found, want, strict=True):
        assert np.array_equal(pool.view(entry.slots[0], SLOT), data)
    assert store.resident_ready == 256 and not store.unchecked
    pool.close()
