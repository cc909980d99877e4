"""Where a save's (or a slower tier's load's) slots come from when the pool is
short: a restart's unchecked blocks, the policy's victims, whole slabs of
another class, or this class's own blocks. Mixed into
pegaflow.cache.block_store.BlockStore, whose index, allocator, policy and
listeners these methods use (the mixin is below it, as pegaflow.cache.tier_loads);
kept apart because choosing victims is that one concern.

The policy's pass skips pinned blocks one by one: with most of the pool leased
it costs ~0.7 s of the event loop at 1,000,000 blocks. So the pass parks the
pinned blocks it passes over (LRUPolicy: out of the order until
BlockStore.unpin drops their last pin), and a pass that comes back short sets
`policy_drained`: the next save skips the pass until a block is published
(policy insert) or unpinned, the two ways a block becomes a victim the policy
can give (BlockStore._make_ready*, BlockStore.unpin). A ready block's pins drop
only in BlockStore.unpin; the others that drop (a save's, a tier load's) are
of blocks not ready, which the policy does not hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from operator import itemgetter

import numpy as np

from pegaflow.common.keys import Key

from .slab_victims import slab_victims
from .slabs import SlotClass


class SlotEviction:
    def _allocate(self, cls: SlotClass, n: int) -> np.ndarray:
        """Up to n slots, evicting LRU blocks (of any class) while short. A
        victim of another class frees memory for this one only when its whole
        slab empties: once a slab's worth of them went in LRU order, whole
        slabs are emptied instead, fewest blocks first (slab_victims)."""
        got = [self.slabs.allocate(cls, n)]
        short = n - len(got[0])
        if short:
            self._settle()
        swept = 0  # bytes of other classes evicted in LRU order
        # The policy gave fewer than asked: none left for this save, nor for
        # the next until a block is published or unpinned (policy_drained).
        drained = self.policy_drained
        while short > 0:
            # Unchecked blocks are the least recently used of all: first,
            # those of this class (each frees a slot this save can take).
            # Past a slab's worth swept, or when the policy has nothing left,
            # the emptiest slab of another class whose blocks may all go
            # (unpinned, or unchecked and pinned only by their check) goes
            # whole: its slots serve this class's next saves too, where an
            # own block behind the sweep would serve one, and every later
            # save would sweep again. None such among those examined: this
            # class's own blocks in LRU order, or the save is refused.
            victims = self._unchecked_victims(cls, short)
            bound = swept >= self.slabs.slab_bytes
            if not victims and not bound and not drained:
                victims = self._evict_lru(short, self._protected, park=True)
                drained = len(victims) < short
                self.policy_drained = drained
                if victims:
                    swept += self._bytes_of_others(victims, cls)  # ns still held
                    self._remove(victims)
            if not victims:
                victims = self._empty_a_slab(cls)
            if not victims and bound:
                victims = self._evict_own(cls, short)
                if victims:
                    self._remove(victims)
            if not victims:
                break
            self.counters.evictions += len(victims)
            got.append(self.slabs.allocate(cls, short))
            short -= len(got[-1])
        return got[0] if len(got) == 1 else np.concatenate(got)

    def _evict_own(self, cls: SlotClass, n: int) -> list[Key]:
        """Up to n blocks of this class, LRU first (the policy passes over
        other classes' blocks as over pinned ones: a scan, in this rare case)."""
        own = {i for i, held in self._held.items() if held.ns.slot_class == cls}
        entries = self.entries
        return self._evict_lru(n, lambda k: k[0] not in own or entries[k].pins > 0)

    def _evict_lru(
        self, n: int, protected: Callable[[Key], bool], park: bool = False
    ) -> list[Key]:
        """Up to n of the policy's victims (out of it, still in the store).
        park: `protected` is "pinned", and the policy may keep the pinned
        blocks it passes over out of later passes until BlockStore.unpin."""
        return self.policy.evict(n, protected, park)

    def _empty_a_slab(self, cls: SlotClass) -> list[Key]:
        """Evict every block of a slab of another class (slab_victims)."""
        victims = slab_victims(self.slabs, self.entries, cls, self.unchecked)
        unchecked = [k for k in victims if k in self.unchecked]
        if unchecked:
            self._drop_unchecked(unchecked)
        if len(unchecked) < len(victims):
            ready = [k for k in victims if k in self.entries]
            self.policy.evict_these(ready)
            self._remove(ready)
        return victims

    def _bytes_of_others(self, keys: list[Key], cls: SlotClass) -> int:
        """The slot bytes these resident blocks hold in classes other than cls."""
        out = 0
        for ns_id, n in Counter(map(itemgetter(0), keys)).items():
            ns = self._held[ns_id].ns
            if ns.slot_class != cls:
                out += n * ns.tp_size * ns.slot_class[0]
        return out

    def _unchecked_victims(self, cls: SlotClass, n: int) -> list[Key]:
        """Up to n unchecked recovered blocks of this slot class, the last
        adopted first (the check reaches them last), that only their check
        pins (a save never does: it waits; a query's check does), dropped
        (_drop_unchecked). Dropping one loses nothing acknowledged since the
        restart; kept, a full pool of them refused every save until the check
        reached them."""
        victims: list[Key] = []
        stack = self._unchecked_stacks.get(cls)
        busy: list[Key] = []
        while stack and len(victims) < n:
            key = stack.pop()
            entry = self.unchecked.get(key)
            if entry is None:  # checked, or evicted, since
                continue
            (victims if entry.pins == 1 else busy).append(key)
        if stack is not None:
            stack.extend(reversed(busy))
        if victims:
            self._drop_unchecked(victims)
        return victims

    def _drop_unchecked(self, keys: list[Key]) -> None:
        """Unchecked blocks out of `unchecked` and of the store."""
        for key in keys:
            del self.unchecked[key]
        for evicted in self._on["unchecked_evicted"]:
            evicted(keys)
        gone = list(map(self.entries.__getitem__, keys))
        self._remove(keys)
        self.on_settle(gone)
