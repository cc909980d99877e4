"""A numpy hash table of ready entries whose hashes share one length, for
the prefix query (ReadyIndex decides when it answers instead of a dict).

Open addressing with linear probing over slots of (key, row). The key is the
hash's hash64 (its first eight bytes; a shorter hash is mapped by a bijection,
see pegaflow.cache.hll) xor a secret fold of its remaining bytes
(open_addressing.keyed_fold), so hashes a client made equal in their first
eight bytes do not share a key; the home slot is multiply-shift with a
secret odd multiplier, so crafted hashes cannot pile onto one home. A row
holds the entry and the bytes past the first eight, which a key match must
also equal: equal keys and equal tails mean equal hashes. A probe reads
every key's home slot (most sit there), then WINDOW slots a round for the
rest. Removal leaves a tombstone. Past MAX_LOAD a
vectorised rebuild resizes and purges tombstones, laying keys out in order of
home slot, as Robin Hood hashing would: that keeps them near home (at load 1/3,
none of 10**6 eight slots away). Probes never wrap: runs may spill into SPARE
slots past the end; a run longer still only comes from a crowd sharing one key,
which a growing table cannot part, so past a few doublings the overflow goes to
a dict (the stash). Inserts wait in a pending set until the next probe, so a
save adds its blocks in one vectorised pass rather than numpy calls per block.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

import numpy as np

from pegaflow.common.hash64 import hash64
from pegaflow.common.keys import PackedHashes
from pegaflow.common.open_addressing import (
    EMPTY,
    SPARE,
    TOMB,
    WINDOW,
    ProbedSlots,
    keyed_fold,
    secret_multipliers,
)

if TYPE_CHECKING:
    from .block_entry import BlockEntry

STASHED = -2  # the slot of a row in the stash (see HashTable._stash)
MAX_LOAD = 0.45  # slots in use (tombstones too) before a rebuild
MIN_CAPACITY = 64
SMALL_REMOVALS = 16  # remove_many of up to this many: remove() each


def _words(tails: np.ndarray) -> np.ndarray:
    """(n, bytes) uint8 -> (n, ceil(bytes / 8)) uint64, zero-padded."""
    n, size = tails.shape
    padded = np.zeros((n, -(-size // 8) * 8), np.uint8)
    padded[:, :size] = tails
    return padded.view("<u8")


class HashTable(ProbedSlots):
    """Ready entries whose hashes have one length: hash -> row -> entry."""

    def __init__(self, hash_len: int, capacity: int = MIN_CAPACITY) -> None:
        self.hash_len = hash_len
        self._tail = max(0, hash_len - 8)  # bytes the key does not cover
        # Home slots by multiply-shift with a secret odd multiplier: universal,
        # so hashes cannot be crafted to share home slots.
        self._mult = np.uint64(secrets.randbits(64) | 1)
        # The key is the first 8 bytes xor a secret fold of the rest: equal
        # keys and equal tails still mean equal hashes (the check below), and
        # hashes sharing their first 8 bytes no longer share one key.
        self._tail_mults = secret_multipliers(-(-self._tail // 8))
        self._entries = np.empty(0, object)
        self._tails = np.empty((0, -(-self._tail // 8)), np.uint64)
        self._slot_of = np.empty(0, np.int64)  # slot of each placed row, or STASHED
        self._free: list[int] = []
        self._pending: dict[int, None] = {}  # rows added since the last probe
        # Rows whose run would pass the table's end however big it grew: only
        # keys equal by the hundred do that, which the secret fold makes as
        # likely as guessing it.
        self._stash: dict[bytes, int] = {}
        self._live = 0  # placed or stashed rows
        self._tombs = 0
        self._window = np.arange(1, WINDOW + 1)[:, None]
        self._alloc(capacity)

    def __len__(self) -> int:
        return self._live + len(self._pending)

    @property
    def nbytes(self) -> int:
        arrays = (self._slots, self._entries, self._tails, self._slot_of)
        return sum(a.nbytes for a in arrays)

    # -- changes ----------------------------------------------------------------
    def add(self, entry: BlockEntry) -> None:
        """The entry's hash (entry.key[1]) must not be in the table."""
        row = self._free.pop() if self._free else self._grow_rows()
        self._entries[row] = entry
        entry.row = row
        self._pending[row] = None

    def add_many(self, entries: list[BlockEntry]) -> None:
        """add() each entry, in order (the same rows)."""
        free = self._free
        rows: list[int] = []
        while len(rows) < len(entries):
            if not free:
                rows.append(self._grow_rows())
                free = self._free
            take = min(len(entries) - len(rows), len(free))
            if take:
                rows += free[: -take - 1 : -1]  # pop() order: from the end
                del free[-take:]
        self._entries[rows] = entries
        for entry, row in zip(entries, rows, strict=True):
            entry.row = row
        self._pending.update(dict.fromkeys(rows))

    def remove(self, entry: BlockEntry) -> None:
        row = entry.row
        slot = int(self._slot_of[row])
        if row in self._pending:
            del self._pending[row]
        elif slot == STASHED:
            del self._stash[entry.key[1]]
            self._live -= 1
        else:  # a tombstone keeps the runs through its slot whole
            self._slots[slot, 1] = TOMB
            self._live -= 1
            self._tombs += 1
        self._slot_of[row] = -1
        self._entries[row] = None
        self._free.append(row)
        entry.row = -1

    def remove_many(self, entries: list[BlockEntry]) -> None:
        """remove() each entry (distinct, all in the table)."""
        if len(entries) <= SMALL_REMOVALS:
            # A save into a full pool evicts as many blocks as it stores: for
            # a 1-block save the ~15 numpy calls below cost ~20 us (dev VM),
            # remove() ~2.
            for entry in entries:
                self.remove(entry)
            return
        rows = [e.row for e in entries]
        at = np.array(rows, np.int64)
        slot = self._slot_of[at]
        waiting = np.zeros(len(rows), bool)
        pending = self._pending
        if pending:
            waiting[:] = [row in pending for row in rows]
            for row in at[waiting].tolist():
                del pending[row]
        for i in np.flatnonzero((slot == STASHED) & ~waiting).tolist():
            del self._stash[entries[i].key[1]]
            self._live -= 1
        tombs = slot[(slot >= 0) & ~waiting]
        self._slots[tombs, 1] = TOMB  # a tombstone keeps the runs through it
        self._live -= len(tombs)
        self._tombs += len(tombs)
        self._slot_of[at] = -1
        self._entries[at] = None
        self._free += rows
        for entry in entries:
            entry.row = -1

    def _grow_rows(self) -> int:
        row = len(self._entries)
        size = max(MIN_CAPACITY, 2 * row)
        self._entries = np.concatenate([self._entries, np.empty(size - row, object)])
        tails = np.zeros((size, self._tails.shape[1]), np.uint64)
        tails[:row] = self._tails
        self._tails = tails
        self._slot_of = np.concatenate([self._slot_of, np.full(size - row, -1)])
        self._free = list(range(size - 1, row, -1))
        return row

    def _flush(self) -> None:
        rows = np.fromiter(self._pending, np.int64, len(self._pending))
        self._pending.clear()
        hashes = b"".join([e.key[1] for e in self._entries[rows].tolist()])
        q = PackedHashes(hashes, self.hash_len, len(rows))
        if self._tail:
            self._tails[rows] = _words(q.matrix()[:, 8:])
        keys = self._keys(q.h64, self._tails[rows].T)
        live = self._live + len(rows)
        used = live + self._tombs
        if used > self._capacity * MAX_LOAD or not self._place(rows, keys):
            self._rebuild(live, rows, keys)

    def _keys(self, h64: np.ndarray, words: np.ndarray | None) -> np.ndarray:
        """The table's key of each hash: its first 8 bytes (h64) xor the
        secret fold of its tail words ((word, hash) uint64)."""
        if words is None or not len(words):
            return h64
        return h64 ^ keyed_fold(list(words), self._tail_mults)

    def _home(self, h64: np.ndarray) -> np.ndarray:
        return (h64 * self._mult >> self._shift).view(np.int64)

    def _rebuild(self, live: int, rows: np.ndarray, h64: np.ndarray) -> None:
        """A fresh table, tombstones gone, holding the placed and stashed rows
        and rows (their keys h64, as _keys made them), sized for a load of
        1/6..1/3. Keys go in order of home slot (as Robin Hood hashing would
        leave them), which keeps runs' stragglers close to home: at load 1/3
        none of 10**6 sits 8 slots away, where inserts in arrival order leave
        thousands."""
        self._slot_of[rows] = -1  # a failed _place may have put some of them
        placed = np.flatnonzero(self._slot_of >= 0)
        stashed = np.fromiter(self._stash.values(), np.int64, len(self._stash))
        keys = np.concatenate(
            [
                self._slots[self._slot_of[placed], 0].view(np.uint64),
                self._keys(
                    hash64(list(self._stash), self.hash_len),
                    self._tails.take(stashed, axis=0).T,
                ),
                h64,
            ]
        )
        rows = np.concatenate([placed, stashed, rows])
        capacity = max(MIN_CAPACITY, 1 << (3 * live).bit_length())
        self._stash.clear()
        self._slot_of[rows] = -1
        while True:
            self._alloc(capacity)
            home = self._home(keys)
            order = np.argsort(home, kind="stable")
            home = home[order]
            step = np.arange(len(home))
            slot = step + np.maximum.accumulate(home - step)
            fits = slot < capacity + SPARE
            if fits.all() or live * 16 < capacity:
                break
            capacity *= 2
        placed = order[fits]
        self._slots[slot[fits], 0] = keys[placed].view(np.int64)
        self._slots[slot[fits], 1] = rows[placed]
        self._slot_of[rows[placed]] = slot[fits]
        for row in rows[order[~fits]].tolist():  # a crowd at the table's end
            self._stash[self._entries[row].key[1]] = row
            self._slot_of[row] = STASHED
        self._live = len(rows)

    # -- the query --------------------------------------------------------------
    def find(self, q: PackedHashes) -> np.ndarray:
        """The row of every hash of q, < 0 where it is not in the table.

        Each numpy call costs ~1 us however small its array, and every element
        of a big one costs too: a first round reads the home slot of each key
        (most sit there), a second a window past it for the rest."""
        if self._pending:
            self._flush()
        if not q.count:
            return np.empty(0, np.int64)
        words = self._query_words(q)
        key64 = self._keys(q.h64, words)
        keys = key64.view(np.int64)
        home = self._home(key64)
        got = self._slots.take(home, axis=0)
        rows = got[:, 1]
        found = np.where(got[:, 0] == keys, rows, EMPTY)
        if words is not None:
            self._verify(found, words)
        todo = np.flatnonzero((found < 0) & (rows != EMPTY))
        if len(todo):
            self._probe_on(found, todo, home[todo], keys, words)
        if self._stash and found.min() < 0:
            self._from_stash(q, found)
        return found

    def _probe_on(
        self,
        found: np.ndarray,
        todo: np.ndarray,
        pos: np.ndarray,
        keys: np.ndarray,
        words: np.ndarray | None,
    ) -> None:
        """Rows of the keys at todo, whose runs go on past pos: a window of
        slots a round, twice as wide each round (a long run, a crowd sharing
        one key, takes a few rounds, not one per WINDOW). Arrays are (slot,
        key), as numpy loops over a short last axis one row at a time."""
        window = self._window
        while len(todo):
            # Clipped to the last slot, which stays empty: the run ends there.
            got = self._slots.take(window + pos, axis=0, mode="clip")
            rows = got[..., 1]
            match = got[..., 0] == keys[todo]
            hits = np.where(match, rows, EMPTY).max(axis=0)
            if words is not None:
                self._verify(hits, words.take(todo, axis=1), match, rows)
            found[todo] = hits
            # A hash sits before the first empty slot of its run (EMPTY is the
            # least row value): no match and no empty slot, the run goes on.
            on = (hits < 0) & (rows.min(axis=0) != EMPTY)
            todo, pos = todo[on], pos[on] + len(window)
            if len(todo) and len(window) < len(self._slots):
                window = np.arange(1, 2 * len(window) + 1)[:, None]

    def _verify(
        self,
        found: np.ndarray,
        words: np.ndarray,
        match: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> None:
        """Keep only the rows whose whole hash is the query's; where a window
        (match, rows) held several with its first 8 bytes, check each."""
        # Every key checked, found or not (a negative row reads some row's
        # tail, then is masked): fewer numpy calls than picking the found.
        wrong = (found >= 0) & self._tail_differs(found, words)
        if not wrong.any():
            return
        at = wrong.nonzero()[0]
        found[at] = EMPTY
        if match is None:  # a home slot: the run goes on, the next round looks
            return
        wi, ki = np.nonzero(match[:, at] & (rows[:, at] >= 0))
        cand = rows[wi, at[ki]]
        same = ~self._tail_differs(cand, words.take(at[ki], axis=1))
        found[at[ki[same]]] = cand[same]

    def _from_stash(self, q: PackedHashes, found: np.ndarray) -> None:
        """Rows of stashed hashes: a dict lookup per miss, paid only once
        something was stashed."""
        hashes, get = q.list(), self._stash.get
        for i in np.flatnonzero(found < 0).tolist():
            found[i] = get(hashes[i], EMPTY)

    def _query_words(self, q: PackedHashes) -> np.ndarray | None:
        """The bytes of q's hashes past their key, as (word, hash) uint64
        (zero-padded like the stored tails)."""
        if not self._tail:
            return None
        if self._tail % 8 == 0:  # a strided view: no copy
            shape, strides = (self._tail // 8, q.count), (8, q.hash_len)
            return np.ndarray(shape, "<u8", q.buf, q.offset + 8, strides)
        return _words(q.matrix()[:, 8:]).T

    def _tail_differs(self, rows: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Whether each row's stored tail differs from words (word, row)."""
        stored = self._tails.take(rows, axis=0).T
        # order="C": loop along the hashes, not along a hash's few words.
        return np.not_equal(stored, words, order="C").any(axis=0)

    def entries(self, rows: np.ndarray) -> np.ndarray:
        """The entries of rows, as an object array."""
        return self._entries[rows]
