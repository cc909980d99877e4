"""The linear-probing core shared by the two numpy hash tables
(pegaflow.cache.hash_table for the server's ready index, pegaflow.metaserver.table
for the cluster index): slot values, the slot array and the vectorised
placement of new keys (ProbedSlots, their base).

A table is an int64 array of (key, row) slots. Probes never wrap: a run may
spill SPARE slots past the last home slot, and the WINDOW slots after those
stay empty, so every run ends inside the array.
"""

from __future__ import annotations

import secrets

import numpy as np

EMPTY, TOMB = -2, -1  # row values of a free slot; EMPTY ends a run
WINDOW = 8  # slots a round reads past the home slot, for the keys not there
SPARE = 1024  # slots past the last home slot that a run may spill into


FOLD_SHIFT = np.uint64(29)  # keyed_fold's xor-shift (metaserver.compiled too)


def secret_multipliers(n: int) -> np.ndarray:
    """n random odd 64-bit multipliers, drawn per table."""
    return np.array([secrets.randbits(64) | 1 for _ in range(n)], np.uint64)


def keyed_fold(
    columns: list[np.ndarray],
    mults: np.ndarray,
    active: list[np.ndarray] | None = None,
    start: np.ndarray | int = 0,
) -> np.ndarray:
    """One uint64 per row of the uint64 columns, mixed with the secret
    multipliers (one per column): a multiply and an xor-shift per column, so
    the fold is not linear in the columns. A linear one (a sum of words
    times odd constants) collides without the secret: flipping the top bit
    of any two words leaves it unchanged. Clients choose the hashes; with
    keys they could make equal, one crowd would be a run of its own length
    on every probe. active[i] (bool per row): where False, column i is
    padding past the row's hash and leaves the fold as it is. start: the fold
    so far (of columns folded before, e.g. ones equal in every row)."""
    acc = np.full(len(columns[0]) if columns else 0, start, np.uint64)
    for i, (column, mult) in enumerate(zip(columns, mults, strict=False)):
        mixed = (acc ^ column) * mult
        mixed ^= mixed >> FOLD_SHIFT
        acc = mixed if active is None else np.where(active[i], mixed, acc)
    return acc


class ProbedSlots:
    """A table's slot array and the placement of new keys in it. Subclasses
    give _home (a key's home slot, from _shift) and keep _slot_of (each row's
    slot, -1 when unfiled) and _live (rows filed)."""

    _slot_of: np.ndarray
    _live: int

    def _home(self, keys: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _alloc(self, capacity: int) -> None:
        """An empty array of `capacity` (a power of two) home slots, with room
        for the runs that spill past the last of them and the empty WINDOW
        after those."""
        self._capacity = capacity
        self._shift = np.uint64(64 - (capacity.bit_length() - 1))
        self._slots = np.zeros((capacity + SPARE + WINDOW, 2), np.int64)  # key, row
        self._slots[:, 1] = EMPTY
        self._tombs = 0

    def _place(self, rows: np.ndarray, keys: np.ndarray) -> bool:
        """Put rows (keys `keys`) in the first free slot of their runs; False
        when a run would pass the spare slots (the caller rebuilds; the rows
        placed in the rounds before stay filed)."""
        pos = self._home(keys)
        todo = np.arange(len(rows))
        slots, slot_rows = self._slots, self._slots[:, 1]
        limit = self._capacity + SPARE
        while len(todo):
            if pos.max() >= limit:
                return False
            free = slot_rows[pos] < 0
            # One new key per free slot in a round; the others try the next slot.
            taken, first = np.unique(pos[free], return_index=True)
            won = todo[free][first]
            self._tombs -= int((slot_rows[taken] == TOMB).sum())
            slots[taken, 0] = keys[won].view(np.int64)
            slot_rows[taken] = rows[won]
            self._slot_of[rows[won]] = taken
            self._live += len(won)
            left = np.ones(len(todo), bool)
            left[np.flatnonzero(free)[first]] = False
            todo, pos = todo[left], pos[left] + 1
        return True
