"""A slab to empty for a save of another slot class
(pegaflow.cache.block_store.BlockStore._allocate).

Slabs move between classes only when they empty (pegaflow.cache.slabs), so a
block of another class frees memory for the save only with the last block of
its slab. Evicting in LRU order until some slab emptied swept most of the pool
once recency was interleaved across slabs (an aged pool): one 1-block save of
a second class evicted 2,794 of 4,096 blocks, 38,080 of 65,536 in 178 ms. So
the store evicts in LRU order only about a slab's worth of another class's
blocks, then empties the slabs chosen here: those with the fewest slots in
use, whose every used slot holds a resident, ready, unpinned block or a
restart's recovered block not checked yet that only its check pins (a leased,
loading or in-flight one, one a query's check reads, or a slot a tier still
writes from keeps the slab). A save short of its own class's unchecked blocks
takes those of other classes this way too: one at a time in adoption order,
they emptied no slab until most were gone (60 of 64 over 4 slabs).
"""

from __future__ import annotations

import numpy as np

from pegaflow.common.keys import Key

from .block_entry import BlockEntry
from .slabs import SlabAllocator, SlotClass

# Slabs examined per round, emptiest first: if each holds a pinned block, the
# store takes the save's own class's blocks in LRU order, or refuses the rest
# of the save (as in a pool full of pinned blocks); examining every slab
# would be a Python pass over the pool per save.
EXAMINED = 64


def slab_victims(
    slabs: SlabAllocator,
    entries: dict[Key, BlockEntry],
    cls: SlotClass,
    unchecked: dict[Key, BlockEntry],
) -> list[Key]:
    """The blocks of the emptiest slab of another class than cls that can
    all go now; none if no slab examined qualifies. `unchecked`: a restart's
    recovered blocks not checked yet; those only their check pins may go."""
    for slab in slabs.emptiest(cls, EXAMINED):
        keys = _evictable(slabs.owners(slab), entries, unchecked)
        if keys:
            return keys
    return []


def _evictable(
    owners: np.ndarray,
    entries: dict[Key, BlockEntry],
    unchecked: dict[Key, BlockEntry],
) -> list[Key] | None:
    """The distinct blocks in the slab's used slots (`owners`, None where
    free), if every one may be evicted now."""
    keys: list[Key] = []
    for entry in dict.fromkeys(filter(None, owners.tolist())):  # once per block
        if entries.get(entry.key) is not entry:  # evicted, a tier writes it
            return None
        if entry.pins != (0 if entry.ready else 1) or (
            not entry.ready and unchecked.get(entry.key) is not entry
        ):
            return None  # pinned, or in flight (unchecked: read by a query)
        keys.append(entry.key)
    return keys
