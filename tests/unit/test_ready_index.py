"""ReadyIndex against a dict: random adds, removes and prefix probes, including
hashes that share their first eight bytes, short hashes, growth, slot reuse and
the stash."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.hash_table import MAX_LOAD, MIN_CAPACITY, SPARE, HashTable
from pegaflow.cache.ready_index import ReadyIndex
from pegaflow.common.hash64 import hash64
from pegaflow.common.keys import PackedHashes


def _entry(h: bytes) -> BlockEntry:
    return BlockEntry((1, h), [1])


class Reference:
    """The index and a dict that must agree with it."""

    def __init__(self) -> None:
        self.index = ReadyIndex()
        self.ref: dict[bytes, BlockEntry] = {}

    def add(self, h: bytes) -> None:
        if h not in self.ref:
            self.ref[h] = e = _entry(h)
            self.index.add(e)

    def remove(self, h: bytes) -> None:
        e = self.ref.pop(h, None)
        if e is not None:
            self.index.remove(e)

    def check(self, query: list[bytes]) -> None:
        found = [self.ref.get(h) for h in query]
        cut = found.index(None) if None in found else len(found)
        want_rest = [f is not None for f in found[cut:]]
        answers = [self.index.prefix_listed(query)]
        sizes = {len(h) for h in query}
        if len(sizes) == 1:  # the hash table (what the fast path asks)
            answers.append(self.index.probe(PackedHashes.pack(query, sizes.pop())))
        for got, rest in answers:
            assert len(got) == cut
            assert all(a is b for a, b in zip(got, found[:cut], strict=True))
            assert rest.tolist() == (want_rest if cut < len(query) else [])
        assert len(self.index) == len(self.ref)
        assert sum(map(len, self.index._tables.values())) == len(self.ref)


def _colliding(rng: np.random.Generator, n: int, size: int = 32) -> list[bytes]:
    """n hashes with one first-8-byte prefix, different past it."""
    head = rng.bytes(8)
    return [head + rng.bytes(size - 8) for _ in range(n)]


def test_hash_sharing_first_eight_bytes_is_found_only_by_itself() -> None:
    rng = np.random.default_rng(1)
    r = Reference()
    same = _colliding(rng, 20)
    for h in same[:10]:
        r.add(h)
    r.check(same)  # the first 10 hit, the other 10 (same key) miss
    r.check(same[:10])
    r.remove(same[3])
    r.check(same[:10])
    r.check(same[4:10])
    for h in same[10:]:
        r.add(h)
    r.check(same)


def test_short_hashes_and_eight_byte_hashes() -> None:
    rng = np.random.default_rng(2)
    r = Reference()
    for size in (1, 3, 7, 8):
        hs = list({rng.bytes(size) for _ in range(200)})
        for h in hs[:150]:
            r.add(h)
        r.check(hs[:150])
        r.check(hs)
    r.check([b"\x01", b"\x01\x00", b"\x01" + bytes(7)])  # padding never aliases


def test_growth_and_slot_reuse_keep_every_key() -> None:
    rng = np.random.default_rng(3)
    r = Reference()
    hs = [rng.bytes(32) for _ in range(20_000)]
    for i in range(0, len(hs), 1000):  # grows through several rebuilds
        for h in hs[i : i + 1000]:
            r.add(h)
        r.check(hs[: i + 1000])
    table = r.index._tables[32]
    cap = table._capacity
    for _ in range(5):  # churn at a steady size: freed slots are reused
        for h in hs[:5000]:
            r.remove(h)
        r.check(hs[5000:])
        for h in hs[:5000]:
            r.add(h)
        r.check(hs)
    assert table._capacity <= 2 * cap
    for h in hs:
        r.remove(h)
    r.check(hs[:10])
    assert len(table) == 0 and not table._pending


def test_remove_before_the_next_probe_and_row_reuse() -> None:
    r = Reference()
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    r.add(a)
    r.remove(a)  # still pending: never placed
    r.add(b)
    r.check([b, a])
    r.remove(b)
    r.add(c)  # takes b's row back
    r.check([c, b])
    r.add(b)
    r.check([b, c, a])


def test_packed_hash64_matches_hash64() -> None:
    rng = np.random.default_rng(4)
    for size in (1, 5, 8, 9, 32, 64):
        hs = [rng.bytes(size) for _ in range(50)]
        q = PackedHashes(b"xx" + b"".join(hs), size, 50, offset=2)
        assert (q.h64 == hash64(hs)).all()
        assert q.list() == hs


def test_a_crowd_sharing_first_eight_bytes_is_found_each_by_itself() -> None:
    rng = np.random.default_rng(5)
    r = Reference()
    same = _colliding(rng, 200)
    others = [rng.bytes(32) for _ in range(300)]
    for h in same + others:
        r.add(h)
    r.check(same + others)
    r.check(others + _colliding(rng, 3))  # same first 8 bytes as none: misses
    for h in same[::2]:
        r.remove(h)
    r.check(same[1::2])
    r.check(same)


def test_a_crowd_past_the_table_end_is_stashed_not_lost() -> None:
    """More hashes with one key than the spare slots, homed at the last slot
    (the multiplier pinned to 1 makes the home the key's top bits, and a
    fold of the tails pinned to 0 keys them by their first 8 bytes: a table
    whose secrets are known): growing cannot help, so the table grows a
    little, then stashes the overflow."""
    rng = np.random.default_rng(7)
    r = Reference()
    crowd = [b"\xff" * 8 + rng.bytes(24) for _ in range(SPARE + 300)]
    others = [rng.bytes(32) for _ in range(300)]
    r.add(others[0])
    r.index._tables[32]._mult = np.uint64(1)
    r.index._tables[32]._tail_mults[:] = 0
    for h in crowd + others[1:]:
        r.add(h)
    r.check(crowd + others)
    table = r.index._tables[32]
    assert table._stash and table._capacity <= 1 << 16
    for h in crowd[::2]:
        r.remove(h)
    r.check(crowd[1::2])
    r.check(crowd)
    for h in [rng.bytes(32) for _ in range(3000)]:  # a rebuild re-places all
        r.add(h)
    r.check(crowd[1::2] + others)


def test_hashes_sharing_their_first_bytes_do_not_crowd() -> None:
    """The attack: a client saves 20,000 hashes equal in their first 8 bytes
    (the table once keyed on those alone: one run of 20,000 slots, each save
    moving it slot by slot on the loop, each probe of an absent one reading
    twice the run, 1.8 s and 372 MiB for 512 of them). Keyed by a secret fold
    of the whole hash they spread like any others: no stash, every key near
    its home slot, and each found only by itself."""
    rng = np.random.default_rng(8)
    table = HashTable(32)
    crowd = [b"\x00" * 8 + rng.bytes(24) for _ in range(20000)]
    table.add_many([_entry(h) for h in crowd])
    absent = [b"\x00" * 8 + rng.bytes(24) for _ in range(512)]
    assert (table.find(PackedHashes(b"".join(absent), 32, len(absent))) < 0).all()
    assert not table._stash
    slots = table._slot_of[table._slot_of >= 0]
    keys = table._slots[slots, 0].view(np.uint64)
    assert (slots - table._home(keys)).max() < 256  # no run of the crowd's size
    found = table.find(PackedHashes(b"".join(crowd), 32, len(crowd)))
    assert (found >= 0).all() and len(set(found.tolist())) == len(crowd)


def test_many_inserts_grow_the_table() -> None:
    """Many keys into a small table: rebuilds keep the load under MAX_LOAD."""
    rng = np.random.default_rng(6)
    table = HashTable(32, capacity=MIN_CAPACITY)
    hs = [rng.bytes(32) for _ in range(5000)]
    entries = [_entry(h) for h in hs]
    for e in entries:
        table.add(e)
    got = table.entries(table.find(PackedHashes.pack(hs, 32))).tolist()
    assert all(g is e for g, e in zip(got, entries, strict=True))
    assert not table._stash and len(table) <= MAX_LOAD * table._capacity


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "query"]),
        st.lists(st.integers(0, 71), min_size=1, max_size=12),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.sampled_from([4, 8, 16, 32]))
def test_random_operations_agree_with_a_dict(ops: list, size: int) -> None:
    """A small universe where a third of the hashes share one first 8 bytes."""
    rng = np.random.default_rng(size)
    universe = [rng.bytes(size) for _ in range(48)]
    if size > 8:
        universe += _colliding(rng, 24, size)
    else:
        universe += [rng.bytes(size) for _ in range(24)]
    r = Reference()
    for op, ids in ops:
        hs = [universe[i] for i in ids]
        if op == "add":
            for h in hs:
                r.add(h)
        elif op == "remove":
            for h in hs:
                r.remove(h)
        else:
            r.check(hs)
    r.check(universe)
