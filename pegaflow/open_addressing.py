"""The linear-probing core shared by the two numpy hash tables
(pegaflow.hash_table for the server's ready index, pegaflow.metaserver.table
for the cluster index): slot values and the vectorised placement of new keys.

A table is an int64 array of (key, row) slots. Probes never wrap: a run may
spill SPARE slots past the last home slot, and the WINDOW slots after those
stay empty, so every run ends inside the array.
"""

from __future__ import annotations

import numpy as np

EMPTY, TOMB = -2, -1  # row values of a free slot; EMPTY ends a run
WINDOW = 8  # slots a round reads past the home slot, for the keys not there
SPARE = 1024  # slots past the last home slot that a run may spill into


def new_slots(capacity: int) -> np.ndarray:
    """An empty table of `capacity` home slots, with room for the runs that
    spill past the last of them and the empty WINDOW after those."""
    slots = np.zeros((capacity + SPARE + WINDOW, 2), np.int64)  # key, row
    slots[:, 1] = EMPTY
    return slots


def place(
    slots: np.ndarray,
    slot_of: np.ndarray,
    home: np.ndarray,
    rows: np.ndarray,
    keys: np.ndarray,
    limit: int,
) -> tuple[bool, int, int]:
    """Put rows (keys `keys`, home slots `home`) in the first free slot of
    their runs, recording each row's slot in slot_of. Returns (whether all
    were placed, how many were, how many tombstones they reused); False when
    a run would reach `limit` (the caller rebuilds the table), with the
    counts of the rounds before."""
    pos = home
    todo = np.arange(len(rows))
    slot_rows = slots[:, 1]
    placed = reused = 0
    while len(todo):
        if pos.max() >= limit:
            return False, placed, reused
        free = slot_rows[pos] < 0
        # One new key per free slot in a round; the others try the next slot.
        taken, first = np.unique(pos[free], return_index=True)
        won = todo[free][first]
        reused += int((slot_rows[taken] == TOMB).sum())
        slots[taken, 0] = keys[won].view(np.int64)
        slot_rows[taken] = rows[won]
        slot_of[rows[won]] = taken
        placed += len(won)
        left = np.ones(len(todo), bool)
        left[np.flatnonzero(free)[first]] = False
        todo, pos = todo[left], pos[left] + 1
    return True, placed, reused
