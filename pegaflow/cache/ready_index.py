"""The ready blocks of a namespace as a numpy hash table, for the prefix query.

A Python dict lookup per hash costs one cache miss after another once the index
outgrows the CPU caches (~250 ns each at a million blocks, so ~0.6 ms for a
2560-block prefix). Here every hash of a query is probed at once: numpy's
gathers issue the misses back to back and they overlap, and a fast-path query
stays one bytes buffer (PackedHashes), with no Python object per hash. A probe
costs ~40 numpy calls whatever its size, so small queries and small namespaces
still go to a dict (ReadyIndex).

The table itself is pegaflow.cache.hash_table.
"""

from __future__ import annotations

from itertools import repeat
from operator import is_not
from typing import TYPE_CHECKING

import numpy as np

from pegaflow.common.keys import PackedHashes

from .hash_table import HashTable

if TYPE_CHECKING:
    from .block_entry import BlockEntry

DICT_BELOW = 1024  # hashes per query, and
TABLE_ABOVE = 1 << 14  # ready blocks per namespace: see ReadyIndex
_ALL_READY = np.zeros(0, bool)  # nothing past the prefix
_ALL_READY.flags.writeable = False


class ReadyIndex:
    """The ready entries of one namespace: a dict by hash, and one HashTable
    per hash length (vLLM gives every block hash one length; others come only
    over gRPC). A probe of the tables costs ~40 numpy calls, 80-300 us on the
    dev VM (more when the server's caches are cold), whatever its size; a dict
    lookup ~40-100 ns per hash while the dict sits in the CPU caches and ~250
    ns once it does not. So the tables answer queries of DICT_BELOW+ hashes
    once the namespace holds TABLE_ABOVE+ blocks, the dict the others
    (measured through the server: see benchmarks/RESULTS.md, issue 2)."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, BlockEntry] = {}
        self._tables: dict[int, HashTable] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def add(self, entry: BlockEntry) -> None:
        h = entry.key[1]
        self._by_hash[h] = entry
        table = self._tables.get(len(h))
        if table is None:
            table = self._tables[len(h)] = HashTable(len(h))
        table.add(entry)

    def add_many(self, entries: list[BlockEntry]) -> None:
        """add() each entry; all of one hash length (a save's blocks)."""
        hashes = [e.key[1] for e in entries]
        h = hashes[0]
        if len(set(map(len, hashes))) != 1:
            for entry in entries:
                self.add(entry)
            return
        self._by_hash.update(zip(hashes, entries, strict=True))
        table = self._tables.get(len(h))
        if table is None:
            table = self._tables[len(h)] = HashTable(len(h))
        table.add_many(entries)

    def remove(self, entry: BlockEntry) -> None:
        h = entry.key[1]
        del self._by_hash[h]
        self._tables[len(h)].remove(entry)

    def remove_many(self, entries: list[BlockEntry]) -> None:
        """remove() each entry (distinct, all here)."""
        by_hash = self._by_hash
        size = len(entries[0].key[1])
        for entry in entries:
            del by_hash[entry.key[1]]
        if any(len(e.key[1]) != size for e in entries):
            for entry in entries:
                self._tables[len(entry.key[1])].remove(entry)
        else:
            self._tables[size].remove_many(entries)

    def prefix(self, q: PackedHashes) -> tuple[list[BlockEntry], np.ndarray]:
        """Entries of the ready prefix of q, and whether each block from the
        first miss on is ready (empty when all are)."""
        if self.probes(len(q)):
            return self.probe(q)
        return self.prefix_listed(q.list())

    def probes(self, n: int) -> bool:
        """Whether a query of n hashes goes to the hash tables."""
        return n >= DICT_BELOW and len(self._by_hash) >= TABLE_ABOVE

    def probe(self, q: PackedHashes) -> tuple[list[BlockEntry], np.ndarray]:
        """prefix() by the hash table."""
        table = self._tables.get(q.hash_len)
        if table is None or not len(table):
            return [], np.zeros(len(q), bool)
        rows = table.find(q)
        if len(rows) == 0 or rows.min() >= 0:
            return table.entries(rows).tolist(), _ALL_READY
        cut = int((rows < 0).argmax())
        return table.entries(rows[:cut]).tolist(), rows[cut:] >= 0

    def prefix_listed(self, hashes: list[bytes]) -> tuple[list[BlockEntry], np.ndarray]:
        """prefix() by the dict, for hashes of any lengths."""
        table = self._by_hash
        try:  # all ready (the common answer): no scan for the first miss
            return list(map(table.__getitem__, hashes)), _ALL_READY
        except KeyError:
            found = list(map(table.get, hashes))
        cut = found.index(None)
        rest = np.fromiter(map(is_not, found[cut:], repeat(None)), bool)
        return found[:cut], rest
