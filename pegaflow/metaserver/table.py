"""(namespace, block hash) -> row, as a numpy open-addressing table.

A dict probe per hash, done one after another by the interpreter, is a cache
miss after another once the index outgrows the CPU caches: that was most of
a 1,000-hash QueryPrefix inside the metaserver (benchmarks/RESULTS.md, issue
11). Here a query's hashes are probed at once, so numpy's gathers issue the
misses back to back and they overlap, and the wire's packed hashes stay one
buffer (PackedHashes): no Python object per hash.

The layout follows pegaflow.cache.ready_index.HashTable (linear probing over slots
of (key, row), tombstones, a rebuild in home-slot order past MAX_LOAD, runs
spilling into SPARE slots past the end, never wrapping). Two differences: the
rows are the index's (this class holds each row's hash, its length and its
namespace, and the index its owners), and the key is a secret nonlinear
fold of the whole hash, its namespace and length (open_addressing.keyed_fold;
a linear one let anyone make hundreds of hashes share a key) rather than its
first 8 bytes. So hashes sharing their first 8 bytes (any client of a
server can send such) do not share a key, no crowd can pile onto one run, and
no stash is needed. A key match is still checked against the whole stored
hash, its length and namespace: equal keys of different hashes are each found
only by themselves.
"""

from __future__ import annotations

import secrets

import numpy as np

from pegaflow.common.keys import MAX_HASH_BYTES, PackedHashes
from pegaflow.common.open_addressing import (
    EMPTY,
    SPARE,
    TOMB,
    WINDOW,
    ProbedSlots,
    keyed_fold,
)

from . import compiled as compiled_loops

MAX_LOAD = 0.5  # slots in use (tombstones too) before a rebuild
MIN_CAPACITY = 64
_WORDS = -(-MAX_HASH_BYTES // 8)


class Keys:
    """Hashes as (n, words) little-endian uint64, zero-padded, and their
    lengths: the wire's packed hashes without a copy when hash_len is a
    multiple of 8. `length`: the one length of all of them (the wire's
    hash_len), None when they differ."""

    __slots__ = ("words", "lens", "count", "length")

    def __init__(
        self, words: np.ndarray, lens: np.ndarray, length: int | None = None
    ) -> None:
        self.words, self.lens, self.count = words, lens, len(lens)
        self.length = length

    @classmethod
    def of(cls, hashes: PackedHashes | list[bytes]) -> Keys:
        if isinstance(hashes, PackedHashes):
            return cls.packed(hashes)
        if hashes and len(set(map(len, hashes))) == 1:
            return cls.packed(PackedHashes.pack(hashes, len(hashes[0])))
        # Mixed lengths come only from in-process callers (tests), never the
        # wire (one hash_len per request): padding each one is fine there.
        width = -(-max(map(len, hashes), default=1) // 8) * 8
        raw = b"".join(h.ljust(width, b"\0") for h in hashes)
        words = np.frombuffer(raw, "<u8").reshape(len(hashes), width // 8)
        return cls(words, np.fromiter(map(len, hashes), np.int32, len(hashes)))

    @classmethod
    def packed(cls, q: PackedHashes) -> Keys:
        n, size = q.count, q.hash_len
        lens = np.full(n, size, np.int32)
        if size % 8 == 0:  # a strided view of the request's buffer
            words = np.ndarray((n, size // 8), "<u8", q.buf, q.offset, (size, 8))
            return cls(words, lens, size)
        padded = np.zeros((n, -(-size // 8) * 8), np.uint8)
        padded[:, :size] = q.matrix()
        return cls(padded.view("<u8"), lens, size)

    @property
    def width(self) -> int:
        return self.words.shape[1]

    def take(self, at: np.ndarray) -> Keys:
        return Keys(self.words[at], self.lens[at], self.length)


class RowTable(ProbedSlots):
    """Which row holds each (namespace, hash). The caller allocates rows;
    add() files them, discard() withdraws them, find() looks them up."""

    def __init__(self, compiled: bool = True) -> None:
        """compiled: find() by the compiled loop where numba is installed."""
        self._mult = np.array(
            [secrets.randbits(64) | 1 for _ in range(_WORDS + 3)], np.uint64
        )  # per word, then length, namespace, home slot
        # A record per row: namespace << 8 | hash length, then the hash's
        # words, zero-padded. One record is one or two cache lines, so a
        # check costs a query's hashes about one miss each.
        self._rec = np.zeros((0, 2), np.uint64)
        self._slot_of = np.zeros(0, np.int64)  # each filed row's slot, else -1
        self._live = self._tombs = 0
        self._window = np.arange(1, WINDOW + 1)[:, None]
        self._alloc(MIN_CAPACITY)
        self._compiled_find = compiled_loops.find() if compiled else None

    @property
    def nbytes(self) -> int:
        arrays = (self._slots, self._rec, self._slot_of)
        return sum(a.nbytes for a in arrays)

    def namespace_of(self, rows: np.ndarray) -> np.ndarray:
        return (self._rec[rows, 0] >> np.uint64(8)).astype(np.int64)

    def grow_rows(self, size: int) -> None:
        old = len(self._rec)
        rec = np.zeros((size, self._rec.shape[1]), np.uint64)
        rec[:old] = self._rec
        self._rec = rec
        self._slot_of = np.concatenate([self._slot_of, np.full(size - old, -1)])

    # -- changes ----------------------------------------------------------------
    def add(self, ns: int, keys: Keys, rows: np.ndarray) -> None:
        """File rows as these keys: distinct, none filed yet (find() said so)."""
        if keys.width >= self._rec.shape[1]:  # a longer hash than any so far
            rec = np.zeros((len(self._rec), 1 + keys.width), np.uint64)
            rec[:, : self._rec.shape[1]] = self._rec
            self._rec = rec
        self._rec[rows] = 0  # a reused row may hold a longer hash's words
        self._rec[rows, 0] = _head(ns, keys.lens)
        self._rec[rows, 1 : 1 + keys.width] = keys.words
        key = self._key(ns, keys)
        if (self._live + self._tombs + len(rows)) > self._capacity * MAX_LOAD or (
            not self._place(rows, key)
        ):
            self._rebuild(rows, key)

    def discard(self, rows: np.ndarray) -> None:
        """Withdraw filed rows (distinct). A tombstone keeps runs through their
        slots whole."""
        self._slots[self._slot_of[rows], 1] = TOMB
        self._slot_of[rows] = -1
        self._live -= len(rows)
        self._tombs += len(rows)

    # -- the query --------------------------------------------------------------
    def find(self, ns: int, keys: Keys) -> np.ndarray:
        """The row of every key in namespace ns, -1 where it is not filed.
        Hashes of one length (the wire's) go by a compiled loop (metaserver.compiled)
        where numba is installed. Here, in numpy: a first round reads every
        key's home slot (most sit there), then a window past it a round,
        twice as wide each round, for the rest."""
        found = np.full(keys.count, -1, np.int64)
        if not keys.count or not self._live:
            return found
        if self._compiled_find is not None and keys.length is not None:
            self._compiled_find(
                self._slots,
                self._rec,
                keys.words,
                np.uint64(keys.length),
                np.uint64(ns),
                self._mult[:_WORDS],
                self._mult[_WORDS],
                self._mult[_WORDS + 1],
                self._mult[_WORDS + 2],
                self._shift,
                found,
            )
            return found
        key = self._key(ns, keys).view(np.int64)
        home = self._home(key.view(np.uint64))
        got = self._slots.take(home, axis=0)
        rows = got[:, 1]
        cand = np.where(got[:, 0] == key, rows, EMPTY)
        at = np.flatnonzero(cand >= 0)
        same = self._same(cand[at], ns, keys, None if len(at) == keys.count else at)
        found[at[same]] = cand[at[same]]
        todo = np.flatnonzero((found < 0) & (rows != EMPTY))
        window, pos = self._window, home[todo]
        while len(todo):
            # Clipped to the last slot, which stays empty: the run ends there.
            got = self._slots.take(window + pos, axis=0, mode="clip")
            rows = got[..., 1]
            wi, ki = np.nonzero((got[..., 0] == key[todo]) & (rows >= 0))
            cand, qi = rows[wi, ki], todo[ki]
            same = self._same(cand, ns, keys, qi)
            found[qi[same]] = cand[same]
            # A key sits before the first empty slot of its run (EMPTY is the
            # least row value): not found and no empty slot, the run goes on.
            on = (found[todo] < 0) & (rows.min(axis=0) != EMPTY)
            todo, pos = todo[on], pos[on] + len(window)
            if len(todo):
                window = np.arange(1, 2 * len(window) + 1)[:, None]
        return found

    def _same(
        self, rows: np.ndarray, ns: int, keys: Keys, at: np.ndarray | None
    ) -> np.ndarray:
        """Whether each filed row holds the whole key at[i] of keys in ns
        (at None: key i)."""
        rec = self._rec.take(rows, axis=0)  # a copy: its columns are cheap
        every = at is None  # all at home, the usual: no gathers
        lens = keys.lens if every else keys.lens.take(at)
        same = rec[:, 0] == _head(ns, lens)
        # A query word past the stored width is of a hash longer than any
        # filed one: the length check rules it out.
        for i in range(min(keys.width, rec.shape[1] - 1)):  # a column at a time
            mine = keys.words[:, i]
            same &= rec[:, 1 + i] == (mine if every else mine.take(at))
        return same

    # -- layout -----------------------------------------------------------------
    def _key(self, ns: int, keys: Keys) -> np.ndarray:
        """The secret fold (open_addressing.keyed_fold) of each hash's length
        and namespace, then its words, a column per 8 bytes; words past a
        hash's length are padding and leave it as it is."""
        n = keys.count
        head = [keys.lens.astype(np.uint64), np.full(n, ns & (1 << 64) - 1, np.uint64)]
        mults = np.concatenate([self._mult[_WORDS : _WORDS + 2], self._mult[:_WORDS]])
        if n and (keys.lens == keys.lens[0]).all():  # the wire's: one hash_len
            # Length and namespace are one value for every row: folded once.
            start = keyed_fold([h[:1] for h in head], mults)[0]
            width = min(-(-int(keys.lens[0]) // 8), keys.width)
            words = np.ascontiguousarray(keys.words[:, :width].T)  # rows of a word
            return keyed_fold(list(words), mults[2:], start=start)
        words = [keys.words[:, i] for i in range(keys.width)]
        padding = [keys.lens > 8 * i for i in range(keys.width)]
        return keyed_fold(head + words, mults, [np.ones(n, bool)] * 2 + padding)

    def _home(self, key: np.ndarray) -> np.ndarray:
        return (key * self._mult[_WORDS + 2] >> self._shift).view(np.int64)

    def _rebuild(self, rows: np.ndarray, key: np.ndarray) -> None:
        """A fresh table, tombstones gone, holding the filed rows and rows (keys
        key), sized for a load of 1/6..1/3. Keys go in order of home slot (as
        Robin Hood hashing would leave them), which keeps runs short."""
        self._slot_of[rows] = -1  # a failed _place may have filed some of them
        filed = np.flatnonzero(self._slot_of >= 0)
        keys = np.concatenate(
            [self._slots[self._slot_of[filed], 0].view(np.uint64), key]
        )
        rows = np.concatenate([filed, rows])
        capacity = max(MIN_CAPACITY, 1 << (3 * len(rows)).bit_length())
        while True:
            self._alloc(capacity)
            home = self._home(keys)
            order = np.argsort(home, kind="stable")
            home = home[order]
            step = np.arange(len(home))
            slot = step + np.maximum.accumulate(home - step) if len(home) else step
            if len(slot) == 0 or slot[-1] < capacity + SPARE:
                break
            # Only keys equal by the hundred overflow, which a secret fold
            # makes as likely as guessing it; a bound, not an endless loop.
            if capacity > 64 * len(rows):
                raise RuntimeError(f"{len(rows)} keys: a run past {SPARE} slots")
            capacity *= 2
        self._slots[slot, 0] = keys[order].view(np.int64)
        self._slots[slot, 1] = rows[order]
        self._slot_of[rows[order]] = slot
        self._live = len(rows)


def _head(ns: int, lens: np.ndarray) -> np.ndarray:
    """A record's first word: namespace << 8 | hash length (<= 64)."""
    return lens.astype(np.uint64) | np.uint64(ns << 8)
