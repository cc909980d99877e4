"""Per node, the index cells it was given: what drops a node's entries without
a pass over the whole index.

A cell is one (row, way) of BlockIndex's owner columns, as row * ways + way.
A node's cells are appended when it is given them (an insert) and never
taken out when they change hands (a removal, an eviction, another owner
taking the way, the row reused for another block): the list is checked
against the owner columns when it is read, and compacted that way once it
holds more than twice the node's entries, so it stays O(entries) in memory
and every append amortised O(1). Dropping a node (stale, fenced, left) is
then O(its cells): with 3,000 nodes of 1,000 entries each, the whole-index
pass per node (12 M cells, ~5 ms each, ~0.3 s on a loaded 2-core VM) was what
a sweep held the lock for, seconds on end (issue 30 #8).
"""

from __future__ import annotations

import numpy as np

_MIN_CAPACITY = 64
_SLACK = 4096  # a list is compacted past 2 x entries + this


class NodeCells:
    def __init__(self, max_nodes: int) -> None:
        self._cells = [np.empty(0, np.int64) for _ in range(max_nodes)]
        self._len = np.zeros(max_nodes, np.int64)

    def add(self, slot: int, cells: np.ndarray, owners: np.ndarray, held: int) -> None:
        """`slot` was given these cells; owners: the flat owner column (for
        the compaction); held: the node's entries now."""
        n, k = int(self._len[slot]), len(cells)
        if not k:
            return
        buf = self._cells[slot]
        if n + k > 2 * held + _SLACK:
            live = self.held(slot, owners)
            n = len(live)
            buf[:n] = live
        if n + k > len(buf):
            grown = np.empty(max(_MIN_CAPACITY, 2 * (n + k)), np.int64)
            grown[:n] = buf[:n]
            buf = self._cells[slot] = grown
        buf[n : n + k] = cells
        self._len[slot] = n + k

    def held(self, slot: int, owners: np.ndarray) -> np.ndarray:
        """The cells `slot` owns now, each once."""
        cells = self._cells[slot][: self._len[slot]]
        return np.unique(cells[owners[cells] == slot])

    def take(self, slots: list[int], owners: np.ndarray) -> np.ndarray:
        """The cells these slots own now, each once; their lists emptied."""
        parts = [self.held(slot, owners) for slot in slots]
        for slot in slots:
            self._cells[slot] = np.empty(0, np.int64)
            self._len[slot] = 0
        return np.concatenate(parts) if parts else np.empty(0, np.int64)
