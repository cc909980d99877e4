"""Slot accounting of the L1 pool: fixed-size slots per size class, carved from
slabs that move between classes. Addresses only; the memory is pegaflow.cache.pool's.
"""

from __future__ import annotations

import numpy as np

SlotClass = tuple[int, int]  # (slot bytes, offset of slot 0 inside its slab)
# Frees of this many slots go slab by slab (SlabAllocator._free_batch).
_BATCH_FREE = 16
_SMALL_TAKE = 16  # slots taken from one slab, addressed without numpy


class SlabAllocator:
    """Fixed-size slots per size class; whole slabs move between classes.

    A slot is named by its absolute address. Slabs that become empty return to the
    shared free list, so a class that shrinks gives memory back to the others. A
    class's slots start `skew` bytes into the slab so they share the engine pages'
    offset modulo 4 KiB: copies between addresses a few bytes apart modulo 4 KiB
    suffer 4K aliasing (process_vm_writev measured 3x slower).
    """

    def __init__(self, base: int, size: int, slab_bytes: int) -> None:
        self.base = base
        self.slab_bytes = slab_bytes
        self.size_slabs = size // slab_bytes
        self.free_slabs: list[int] = list(range(self.size_slabs - 1, -1, -1))
        self._slab_class: dict[int, SlotClass] = {}
        self._free_slots: dict[int, list[int]] = {}  # slab -> free slot indices
        self._partial: dict[SlotClass, dict[int, None]] = {}  # slabs with room
        self.used_bytes = 0
        # Per slab, its slots allocated and its class's number (-1: a free
        # slab): a save of one class short of room picks the emptiest slab of
        # another (emptiest) in numpy, with no pass over the slabs in Python.
        self.used = np.zeros(self.size_slabs, np.int64)
        self.class_no = np.full(self.size_slabs, -1, np.int32)
        self._class_nos: dict[SlotClass, int] = {}
        # Per slab with a class, the block in each of its slots (None while
        # free; the store sets it: own()): a slab's blocks are one slice, and
        # 8 B a slot of slabs in use, not a dict entry (~40 B) a slot. Cleared
        # by every free, whoever frees (the store, a tier, a restart).
        self._owners: list[np.ndarray | None] = [None] * self.size_slabs

    def slots_per_slab(self, cls: SlotClass) -> int:
        slot_bytes, skew = cls
        return (self.slab_bytes - skew) // slot_bytes

    def allocate(self, cls: SlotClass, n: int) -> np.ndarray:
        """Up to n slot addresses of the class (fewer when memory runs out)."""
        slot_bytes, skew = cls
        if not 0 <= skew < 4096 or self.slots_per_slab(cls) < 1 or slot_bytes <= 0:
            raise ValueError(f"slot of {slot_bytes} bytes does not fit a slab")
        partial = self._partial.setdefault(cls, {})
        out: list[np.ndarray] = []
        need = n
        while need > 0:
            if not partial:
                if not self.free_slabs:
                    break
                slab = self.free_slabs.pop()
                self._slab_class[slab] = cls
                self.class_no[slab] = self._class_no(cls)
                self._free_slots[slab] = list(
                    range(self.slots_per_slab(cls) - 1, -1, -1)
                )
                self._owners[slab] = np.empty(self.slots_per_slab(cls), object)
                partial[slab] = None
            slab = next(iter(partial))
            free = self._free_slots[slab]
            take = free[-need:] if need < len(free) else free[:]
            del free[len(free) - len(take) :]
            self.used[slab] += len(take)
            if not free:
                del partial[slab]
            start = self.base + slab * self.slab_bytes + skew
            # Rising addresses within a slab (the free list runs downwards, and
            # freed slots come back in any order): consecutive blocks then
            # coalesce into long iovecs (and DMA runs) with the engine's pages.
            take.sort()
            if len(take) <= _SMALL_TAKE:  # a 1-block save: Python ints are cheaper
                out.append(np.array([start + i * slot_bytes for i in take], np.uint64))
            else:
                out.append(start + np.asarray(take, np.uint64) * np.uint64(slot_bytes))
            need -= len(take)
        if len(out) == 1:
            got = out[0]
        else:
            got = np.concatenate(out) if out else np.empty(0, np.uint64)
        self.used_bytes += len(got) * slot_bytes
        return got

    def free(self, addresses: np.ndarray) -> None:
        addresses = np.asarray(addresses, np.uint64)
        if len(addresses) >= _BATCH_FREE:
            self._free_batch(addresses)
            return
        for addr in addresses.tolist():
            off = addr - self.base
            slab = off // self.slab_bytes
            cls = self._slab_class[slab]
            slot_bytes, skew = cls
            free = self._free_slots[slab]
            index = (off % self.slab_bytes - skew) // slot_bytes
            free.append(index)
            self._owners[slab][index] = None
            self.used_bytes -= slot_bytes
            self.used[slab] -= 1
            if len(free) == self.slots_per_slab(cls):
                self._release_slab(slab, cls)
            else:
                self._partial[cls][slab] = None

    def _free_batch(self, addresses: np.ndarray) -> None:
        """free() slab by slab: the same free lists, partial slabs and slab
        releases (in the order the loop makes them), with numpy per address
        and Python per slab."""
        off = addresses - np.uint64(self.base)
        slabs = off // np.uint64(self.slab_bytes)
        order = np.argsort(slabs, kind="stable")
        uniq, start, counts = np.unique(
            slabs[order], return_index=True, return_counts=True
        )
        self.used[uniq.astype(np.intp)] -= counts
        ids = uniq.tolist()
        classes = [self._slab_class[s] for s in ids]
        size = np.repeat(np.array([c[0] for c in classes], np.uint64), counts)
        skew = np.repeat(np.array([c[1] for c in classes], np.uint64), counts)
        index = ((off[order] % np.uint64(self.slab_bytes) - skew) // size).tolist()
        first = order[start].tolist()  # where each slab first appears
        last = order[start + counts - 1].tolist()  # and where it last does
        bounds = (start + counts).tolist()
        released: list[tuple[int, int, SlotClass]] = []
        for i in sorted(range(len(ids)), key=first.__getitem__):
            slab, cls = ids[i], classes[i]
            free = self._free_slots[slab]
            mine = index[bounds[i] - int(counts[i]) : bounds[i]]
            free += mine
            self._owners[slab][mine] = None
            self.used_bytes -= cls[0] * int(counts[i])
            if len(free) == self.slots_per_slab(cls):
                released.append((last[i], slab, cls))
            else:
                self._partial[cls][slab] = None
        for _, slab, cls in sorted(released):
            self._release_slab(slab, cls)

    def _release_slab(self, slab: int, cls: SlotClass) -> None:
        self._partial[cls].pop(slab, None)
        del self._free_slots[slab]
        del self._slab_class[slab]
        self.class_no[slab] = -1
        self._owners[slab] = None
        self.free_slabs.append(slab)

    def claim(self, addresses: list[int], slot_bytes: int) -> list[bool]:
        """Take these slots as allocated (a recovered pool's): True per slot
        taken; False where the slab holds another class, lies outside the
        pool, or the slot was taken already, by this call or an earlier one
        (recovery claims each namespace's slots in turn, and namespaces of one
        slot size share slabs). Before any allocation."""
        free_in: dict[int, set[int]] = {}  # slab -> its free slots, as claimed
        fresh: set[int] = set()  # slabs this call gave a class
        ok: list[bool] = []
        for addr in addresses:
            slab, inside = divmod(addr - self.base, self.slab_bytes)
            skew, index = inside % slot_bytes, inside // slot_bytes
            cls = (slot_bytes, skew)
            if not 0 <= slab < self.size_slabs or skew >= 4096:
                ok.append(False)
                continue
            have = self._slab_class.get(slab)
            if have is None:
                self._slab_class[slab] = have = cls
                fresh.add(slab)
                free_in[slab] = set(range(self.slots_per_slab(cls)))
            elif slab not in free_in:
                free_in[slab] = set(self._free_slots.get(slab, ()))
            free = free_in[slab]
            good = have == cls and index in free
            if good:
                free.remove(index)
                self.used_bytes += slot_bytes
            ok.append(good)
        for slab, free in free_in.items():
            cls = self._slab_class[slab]
            if slab in fresh and len(free) == self.slots_per_slab(cls):
                del self._slab_class[slab]  # nothing taken: it stays a free slab
                fresh.discard(slab)
                continue
            self._free_slots[slab] = sorted(free, reverse=True)
            if self._owners[slab] is None:
                self._owners[slab] = np.empty(self.slots_per_slab(cls), object)
            self.used[slab] = self.slots_per_slab(cls) - len(free)
            self.class_no[slab] = self._class_no(cls)
            partial = self._partial.setdefault(cls, {})
            if free:
                partial[slab] = None
            else:
                partial.pop(slab, None)
        self.free_slabs = [s for s in self.free_slabs if s not in fresh]
        return ok

    def _class_no(self, cls: SlotClass) -> int:
        return self._class_nos.setdefault(cls, len(self._class_nos))

    def emptiest(self, cls: SlotClass, n: int) -> list[int]:
        """Up to n slabs of classes other than cls, fewest slots allocated
        first; ties: the lower slab number (one sort key, deterministic)."""
        mine = self._class_nos.get(cls, -1)
        slabs = np.flatnonzero((self.class_no >= 0) & (self.class_no != mine))
        rank = self.used[slabs] * self.size_slabs + slabs  # unique per slab
        if len(rank) > n:  # O(slabs), not a sort of them all
            pick = np.argpartition(rank, n - 1)[:n]
            slabs, rank = slabs[pick], rank[pick]
        return slabs[np.argsort(rank)].tolist()

    def own(self, addresses: np.ndarray, owners: list | np.ndarray) -> None:
        """Record the block (any object) each of these allocated slots holds."""
        addresses = np.asarray(addresses, np.uint64)
        if len(addresses) < _BATCH_FREE:  # a 1-block save: Python ints are cheaper
            size = self.slab_bytes
            for addr, owner in zip(addresses.tolist(), owners, strict=True):
                slab, inside = divmod(addr - self.base, size)
                slot_bytes, skew = self._slab_class[slab]
                self._owners[slab][(inside - skew) // slot_bytes] = owner
            return
        slabs, index = self._locate(addresses)
        values = _objects(owners)
        order = np.argsort(slabs, kind="stable")
        uniq, start = np.unique(slabs[order], return_index=True)
        ends = [*start[1:].tolist(), len(order)]
        for slab, lo, hi in zip(uniq.tolist(), start.tolist(), ends, strict=True):
            pick = order[lo:hi]
            self._owners[slab][index[pick]] = values[pick]

    def owners(self, slab: int) -> np.ndarray:
        """The block in each slot of the slab (None where free); a view."""
        return self._owners[slab]

    def owners_at(self, addresses: np.ndarray) -> list:
        """The block recorded in each of these allocated slots."""
        slabs, index = self._locate(np.asarray(addresses, np.uint64))
        where = zip(slabs.tolist(), index.tolist(), strict=True)
        return [self._owners[s][i] for s, i in where]

    def _locate(self, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's slab, and its index there (slabs with a class)."""
        off = addresses - np.uint64(self.base)
        slabs = (off // np.uint64(self.slab_bytes)).astype(np.intp)
        uniq, inverse = np.unique(slabs, return_inverse=True)
        classes = [self._slab_class[s] for s in uniq.tolist()]
        size = np.array([c[0] for c in classes], np.uint64)[inverse]
        skew = np.array([c[1] for c in classes], np.uint64)[inverse]
        inside = off % np.uint64(self.slab_bytes) - skew
        return slabs, (inside // size).astype(np.intp)

    def free_slots(self, cls: SlotClass) -> int:
        """Slots of the class obtainable without eviction."""
        partial = self._partial.get(cls, {})
        room = sum(len(self._free_slots[s]) for s in partial)
        return room + len(self.free_slabs) * self.slots_per_slab(cls)


def _objects(values: list | np.ndarray) -> np.ndarray:
    """A 1-D object array of these values (np.asarray would look inside them)."""
    if isinstance(values, np.ndarray):
        return values
    out = np.empty(len(values), object)
    out[:] = values
    return out
