"""Blocks that reach L1 from elsewhere than a save: a slower tier's load (the
SSD, a peer) into freshly reserved slots, and a restarted server's recovered
pool. Mixed into pegaflow.cache.block_store.BlockStore, whose index, allocator
and listeners these methods use (so they name no type of that module: the mixin
is below it); kept apart because they are that one concern."""

from __future__ import annotations

import numpy as np

from pegaflow.common.keys import BlockHash, Namespace

from .block_entry import BlockEntry


class TierLoads:
    def reserve_load(self, ns: Namespace, hashes: list[BlockHash]) -> list[BlockEntry]:
        """Pinned, in-flight entries with slots for blocks coming from a slower
        tier; stops at the first key already known or when no slot can be freed.
        In flight on every layer, a concurrent save of the key deduplicates."""
        tp, complete = ns.tp_size, (1 << (ns.tp_size * ns.num_layers)) - 1
        entries: list[BlockEntry] = []
        for h in hashes:
            key = (ns.id, h)
            if key in self.entries:
                break
            entry = BlockEntry(key, [0] * tp, in_flight=complete, pins=1)
            self.entries[key] = entry  # before allocating: never its own victim
            self.unready[key] = entry
            entries.append(entry)
        if not entries:
            return []
        self._hold(ns, len(entries))
        got = self._allocate(ns.slot_class, len(entries) * tp)
        whole = len(got) // tp
        for i, entry in enumerate(entries[:whole]):
            entry.slots[:] = got[i * tp : (i + 1) * tp].tolist()
        held = [e for e in entries[:whole] for _ in range(tp)]
        self.slabs.own(got[: whole * tp], held)
        if self.log is not None and whole:
            shards = got[: whole * tp].reshape(whole, tp)
            for shard in range(tp):
                self.log.writing(ns, hashes[:whole], shard, shards[:, shard])
        self.slabs.free(got[whole * tp :])
        for entry in entries[whole:]:
            del self.entries[entry.key]
        if whole < len(entries):
            self._let_go({ns.id: len(entries) - whole})
        return entries[:whole]

    def finish_load(
        self,
        entries: list[BlockEntry],
        ok: np.ndarray,
        withhold: np.ndarray | None = None,
        cold: np.ndarray | None = None,
    ) -> np.ndarray:
        """Blocks that arrived become ready (visible, evictable); the rest go.
        The slots of those that did not arrive and are marked in `withhold`
        (a read may still write them) stay allocated: returned, for the caller
        to hand back through free_withheld once nothing can write them.
        Those marked in `cold` no one asked for (a restart's check reached
        them): they enter below every resident block, not as just used."""
        self.apply_touches()
        lost: list[np.ndarray] = []
        held: list[np.ndarray] = []
        published: list[BlockEntry] = []
        unused: list[BlockEntry] = []
        keep = withhold.tolist() if withhold is not None else [False] * len(entries)
        unasked = cold.tolist() if cold is not None else [False] * len(entries)
        if self.unchecked:  # a restart's check (pegaflow.server.pool_check)
            for entry in entries:
                self.unchecked.pop(entry.key, None)
            if not self.unchecked:  # a dict keeps its table, emptied
                self.unchecked = {}
                self._unchecked_stacks.clear()
        for entry, good, hold, idle in zip(
            entries, ok.tolist(), keep, unasked, strict=True
        ):
            entry.pins -= 1
            if good:  # in flight on every bit: those are the complete block
                entry.landed, entry.in_flight = entry.in_flight, 0
                (unused if idle else published).append(entry)
            else:
                entry.in_flight = 0
                (held if hold else lost).append(entry.slot_array())
                self._pop_entry(entry.key)
        if lost:
            self.slabs.free(np.concatenate(lost))
        if unused:
            self._make_ready_many(unused, cold=True)
        if published:
            self._make_ready_many(published)
        published += unused
        if published and self.log is not None:
            self.log.landed(published)
        if published:
            for ready in self._on["ready"]:
                ready(published)
        self.on_settle(entries)
        return np.concatenate(held) if held else np.empty(0, np.uint64)

    def free_withheld(self, slots: np.ndarray) -> None:
        """Slots finish_load withheld, now that nothing can write them."""
        if len(slots):
            self.slabs.free(slots)

    def adopt(
        self,
        ns: Namespace,
        hashes: list[BlockHash],
        slots: np.ndarray,
        unchecked: bool = False,
    ) -> list[BlockEntry]:
        """Blocks already in their slots ([blocks, shards], claimed from the
        allocator): a restarted server's recovered pool; the entries made
        (a key already known is skipped). Ready at once, least recently used
        first as the policy sees them; or, `unchecked`, pinned and in flight
        (never served; a save of the key waits for its check) until
        finish_load says whether their bytes passed the check; meanwhile
        evicted first when the pool is full (BlockStore.unchecked)."""
        complete = (1 << (ns.tp_size * ns.num_layers)) - 1
        stack = self._unchecked_stacks.setdefault(ns.slot_class, [])
        fresh: list[BlockEntry] = []
        for h, row in zip(hashes, slots.tolist(), strict=True):
            key = (ns.id, h)
            if key in self.entries:
                continue
            if unchecked:
                entry = BlockEntry(key, row, in_flight=complete, pins=1)
                self.unchecked[key] = entry
                stack.append(key)
            else:
                entry = BlockEntry(key, row, landed=complete)
                self._make_ready(entry)
            # Not in `unready`: pinned by its check until finish_load, never
            # stale, and the sweep would read every one each second.
            self.entries[key] = entry
            fresh.append(entry)
        if fresh:
            self._hold(ns, len(fresh))
            addrs = np.array([a for e in fresh for a in e.slots], np.uint64)
            self.slabs.own(addrs, [e for e in fresh for _ in e.slots])
        if fresh and not unchecked:
            for ready in self._on["ready"]:
                ready(fresh)
        return fresh
