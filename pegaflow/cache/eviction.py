"""Eviction policies for the L1 pool: which resident key goes next.

The pool owns slots, refcounts and leases; a policy only orders keys and picks
victims. `evict(n, protected)` is atomic: exactly n victims, or `None` and nothing
changed. `protected(key)` lets the pool veto leased or in-flight keys without the
policy knowing about leases.

Admission is a wrapper, not a flag. Every policy hands out an `admitter(protected)`
for one request's candidates past the free room: `LRUPolicy`'s always says yes,
and `AdmissionPolicy(LRUPolicy(), TinyLFU(capacity))`'s says yes only when the
candidate was seen more often than the victim it would displace (each admitted
candidate displaces the next one). So the pool's miss path is the same with or
without admission:

    admit = policy.admitter(protected)
    for key in past_the_room:
        if not admit(key):
            continue  # keep what we have; the miss is still counted
        ...  # later: policy.evict(admitted, protected); policy.insert(key)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from functools import partial
from itertools import compress, repeat
from operator import not_
from typing import Protocol

import numpy as np

Key = Hashable  # any hashable: the store passes pegaflow.common.keys.Key
Protected = Callable[[Key], bool]

_MASK64 = (1 << 64) - 1
# Frequencies past this say nothing new, and a low cap lets aging forget fast.
_COUNTER_MAX = 255
# Counters are uint16 so np.add.at has headroom: 255 + 2**15 < 2**16 cannot wrap
# before the chunk is clipped back to _COUNTER_MAX.
_CHUNK = 1 << 15
_DOORKEEPER_HASHES = 2
# Bool entries per sampled access: <16 % false positives with 2 hashes even when
# every access of a period is a distinct key.
_DOORKEEPER_BITS_PER_SAMPLE = 4
# Admitted-but-not-yet-inserted keys; past this the pool is dropping admissions and
# forgetting them costs only a double count.
_MAX_PENDING = 4096


class EvictionPolicy(Protocol):
    def insert(self, key: Key) -> None: ...
    def insert_many(self, keys: Sequence[Key]) -> None: ...  # insert each, in order
    # Keys no one used yet (a restart's recovered blocks, once checked): below
    # every resident key, in order (the first leaves first); not an access.
    def insert_cold_many(self, keys: Sequence[Key]) -> None: ...
    def touch(self, key: Key) -> None: ...
    def touch_many(self, keys: Sequence[Key]) -> None: ...  # all resident, in order
    def remove(self, key: Key) -> None: ...
    # Resident keys the store chose itself (a slab's blocks, to empty it:
    # pegaflow.cache.slab_victims): out, as evicted.
    def evict_these(self, keys: Sequence[Key]) -> None: ...
    # A query's claim: `child`, not resident yet, extends resident `parent`
    # (pegaflow.cache.prefix_eviction); LRU ignores it.
    def expect(self, child: Key, parent: Key) -> None: ...
    # Up to n victims, out of the policy, in one pass: fewer (none) where
    # fewer are unprotected. It used to answer None then, and the store asked
    # again for half as many: one save into a pool of 1,000,000 blocks, all
    # but 10 leased, held the event loop 16.5 s (benchmarks/RESULTS.md).
    # park: `protected` means pinned, and a pinned key passed over may be kept
    # out of later passes until the store says its pins are gone (unpark).
    def evict(self, n: int, protected: Protected, park: bool = False) -> list[Key]: ...

    # Keys parked by evict (a Container; empty where a policy never parks).
    parked: Container[Key]

    # These keys' pins are gone (parked or not): back into the order.
    def unpark(self, keys: Sequence[Key]) -> None: ...
    # For a request's candidates beyond the free room, in order: each one
    # admitted displaces the next victim, so the next candidate faces that one.
    def admitter(self, protected: Protected) -> Callable[[Key], bool]: ...
    def victims(self, protected: Protected) -> Iterator[Key]: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first; O(1) insert/touch/remove.

    evict scans from the LRU end and skips protected keys. With park=True
    (protected = pinned) the pinned keys it passes over leave the order until
    the store unparks them, so each pinned key is passed over once per pin,
    not once per eviction pass: a pool mostly leased cost every save a pass
    over its leases (0.73 s at 1,000,000 blocks, benchmarks/RESULTS.md).

    A parked key is unparked at the LRU end, where the pass found it: it was
    then the least recently used key left. One touched while parked was used
    since, and goes to the MRU end instead.
    """

    def __init__(self) -> None:
        # Values unused: the dict's order is the recency order, LRU first.
        self._order: OrderedDict[Key, None] = OrderedDict()
        # Parked keys: True if touched while parked (None or False if not).
        self.parked: dict[Key, bool | None] = {}

    def insert(self, key: Key) -> None:
        self.parked.pop(key, None)
        self._order[key] = None
        self._order.move_to_end(key)

    def insert_many(self, keys: Sequence[Key]) -> None:
        # A save's blocks: C-level passes, as touch_many. A key already here
        # moves to the MRU end, as insert() moves it.
        if self.parked:
            deque(map(self.parked.pop, keys, repeat(None)), maxlen=0)
        order = self._order
        before = len(order)
        order.update(zip(keys, repeat(None)))
        if len(order) - before != len(keys):
            deque(map(order.move_to_end, keys), maxlen=0)

    def insert_cold_many(self, keys: Sequence[Key]) -> None:
        if self.parked:
            deque(map(self.parked.pop, keys, repeat(None)), maxlen=0)
        order = self._order
        order.update(zip(keys, repeat(None)))
        deque(map(partial(order.move_to_end, last=False), reversed(keys)), maxlen=0)

    def touch(self, key: Key) -> None:
        if key in self._order:
            self._order.move_to_end(key)
        elif key in self.parked:
            self.parked[key] = True

    def touch_many(self, keys: Sequence[Key]) -> None:
        # The prefix-query hot path: one C-level pass (a zero-length deque
        # consumes the map), no Python frame per key. Keys must be resident;
        # a parked one (leased long ago, hit again) takes the slow path.
        try:
            deque(map(self._order.move_to_end, keys), maxlen=0)
        except KeyError:
            deque(map(self.touch, keys), maxlen=0)

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)
        self.parked.pop(key, None)

    def evict_these(self, keys: Sequence[Key]) -> None:
        deque(map(self._order.pop, keys, repeat(None)), maxlen=0)
        if self.parked:
            deque(map(self.parked.pop, keys, repeat(None)), maxlen=0)

    def expect(self, child: Key, parent: Key) -> None:
        pass

    def evict(self, n: int, protected: Protected, park: bool = False) -> list[Key]:
        if n < 0:
            raise ValueError(f"evict: n must be >= 0, got {n}")
        if n == 0:
            return []
        victims: list[Key] = []
        passed: list[Key] = []
        for key in self._order:
            if not protected(key):
                victims.append(key)
                if len(victims) == n:
                    break
            elif park:
                passed.append(key)
        pop = self._order.pop
        deque(map(pop, victims), maxlen=0)
        if park and passed:
            self._park(passed)
        return victims

    def _park(self, passed: list[Key]) -> None:
        order, parked = self._order, self.parked
        if len(passed) < len(order):
            deque(map(order.pop, passed), maxlen=0)
            # No tuple per key (zip's): 1,000,000 of them set off collections.
            parked.update(dict.fromkeys(passed))
            return
        # Every key left was passed (a pool all but leased): the order becomes
        # the parked set whole, the smaller merged into the larger; moving
        # 1,000,000 keys one by one cost this pass a third more.
        if len(parked) > len(order):
            parked.update(order)
        else:
            order.update(parked)
            self.parked = order
        self._order = OrderedDict()

    def unpark(self, keys: Sequence[Key]) -> None:
        parked = self.parked
        back = [k for k in keys if k in parked]
        if not back:
            return
        touched = list(map(parked.pop, back))
        if not any(touched):
            self.insert_cold_many(back)
            return
        self.insert_cold_many(list(compress(back, map(not_, touched))))
        self._order.update(dict.fromkeys(compress(back, touched)))

    def admitter(self, protected: Protected) -> Callable[[Key], bool]:
        return _admit_all

    def victims(self, protected: Protected) -> Iterator[Key]:
        """Unprotected keys from the LRU end, lazily; valid while the order
        does not change (one request's reservation)."""
        return (key for key in self._order if not protected(key))

    def __len__(self) -> int:
        return len(self._order) + len(self.parked)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self.parked


def _admit_all(candidate: Key) -> bool:
    return True


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


class TinyLFU:
    """Approximate access frequencies: count-min sketch behind a doorkeeper.

    A key's first occurrence in a period only sets the doorkeeper (a bloom filter),
    so one-hit wonders never reach the sketch. Every `sample_size` recorded accesses
    the counters halve and the doorkeeper clears, so old popularity fades.

    Indices come from hash(key), which is stable within one process only; the
    sketch is never persisted or shared, so that is enough.
    """

    def __init__(
        self,
        capacity_hint: int,
        *,
        sample_factor: int = 10,
        depth: int = 4,
        seed: int = 0,
    ) -> None:
        if capacity_hint < 1 or sample_factor < 1 or depth < 1:
            raise ValueError("TinyLFU: capacity_hint, sample_factor, depth must be > 0")
        width = max(1024, _next_pow2(capacity_hint))
        self.sample_size = sample_factor * capacity_hint
        dk_size = _next_pow2(self.sample_size * _DOORKEEPER_BITS_PER_SAMPLE)
        self._table = np.zeros((depth, width), dtype=np.uint16)
        self._doorkeeper = np.zeros(max(1024, dk_size), dtype=np.bool_)
        self._samples = 0
        # Multiply-shift hashing: the top bits of (h ^ salt) * odd form a universal
        # family, so rows (and the doorkeeper's hashes) are independent enough.
        rng = np.random.default_rng(seed)
        n_hashes = depth + _DOORKEEPER_HASHES
        params = rng.integers(0, 1 << 64, size=(2, n_hashes), dtype=np.uint64)
        params[1] |= np.uint64(1)
        self._salts, self._mults = params
        self._shifts = np.array(
            [64 - (width.bit_length() - 1)] * depth
            + [64 - (self._doorkeeper.size.bit_length() - 1)] * _DOORKEEPER_HASHES,
            dtype=np.uint64,
        )
        # Python-int copies: the scalar path avoids numpy scalars (slow, and they
        # warn on the wrap-around the hash relies on).
        self._hash_params = [
            (int(s), int(m), int(sh))
            for s, m, sh in zip(self._salts, self._mults, self._shifts, strict=True)
        ]
        self._depth = depth

    def _indices(self, key: Key) -> list[int]:
        h = hash(key) & _MASK64
        return [((h ^ s) * m & _MASK64) >> sh for s, m, sh in self._hash_params]

    def _indices_many(self, hashes: np.ndarray) -> np.ndarray:
        """(depth + doorkeeper hashes, len(hashes)) indices; same as _indices."""
        mixed = (hashes[None, :] ^ self._salts[:, None]) * self._mults[:, None]
        return (mixed >> self._shifts[:, None]).astype(np.intp)

    def record(self, key: Key) -> None:
        idx = self._indices(key)
        rows, dk = idx[: self._depth], idx[self._depth :]
        if all(self._doorkeeper[i] for i in dk):
            for r, i in enumerate(rows):
                if self._table[r, i] < _COUNTER_MAX:
                    self._table[r, i] += 1
        else:
            self._doorkeeper[dk] = True
        self._advance(1)

    def record_many(self, keys: Sequence[Key]) -> None:
        """Same effect as record() on each key in order.

        Exception: a bloom false positive caused by a different key earlier in the
        same chunk is not modelled (rare, and only a one-count difference).
        """
        hashes = np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys))
        hashes = hashes.view(np.uint64)
        start = 0
        while start < len(hashes):
            # Split at the aging point so it happens where repeated record() would.
            step = min(_CHUNK, self.sample_size - self._samples, len(hashes) - start)
            self._record_chunk(hashes[start : start + step])
            self._advance(step)
            start += step

    def _record_chunk(self, hashes: np.ndarray) -> None:
        uniq, counts = np.unique(hashes, return_counts=True)
        idx = self._indices_many(uniq)
        rows, dk = idx[: self._depth], idx[self._depth :]
        known = self._doorkeeper[dk].all(axis=0)
        # A key new to the doorkeeper spends its first occurrence there.
        self._doorkeeper[dk[:, ~known]] = True
        incr = counts - ~known
        hot = incr > 0
        flat = rows[:, hot] + (np.arange(self._depth)[:, None] * self._table.shape[1])
        flat = flat.ravel()
        table = self._table.reshape(-1)
        values = np.broadcast_to(incr[hot].astype(np.uint16), rows[:, hot].shape)
        np.add.at(table, flat, values.ravel())
        table[flat] = np.minimum(table[flat], _COUNTER_MAX)

    def _advance(self, n: int) -> None:
        self._samples += n
        if self._samples >= self.sample_size:
            self._table >>= 1
            self._doorkeeper[:] = False
            self._samples = 0

    def estimate(self, key: Key) -> int:
        idx = self._indices(key)
        rows, dk = idx[: self._depth], idx[self._depth :]
        count = min(int(self._table[r, i]) for r, i in enumerate(rows))
        return count + int(all(self._doorkeeper[i] for i in dk))

    def admit(self, candidate: Key, victim: Key) -> bool:
        return self.estimate(candidate) > self.estimate(victim)


class AdmissionPolicy:
    """Wraps an EvictionPolicy; admits a candidate only if TinyLFU rates it above
    the victim it would displace. Every access (hit, miss, insert) is recorded."""

    def __init__(self, inner: EvictionPolicy, sketch: TinyLFU) -> None:
        self._inner = inner
        self._sketch = sketch
        # Keys whose current access an admitter already recorded; their insert
        # must not count it twice.
        self._pending: set[Key] = set()

    def insert(self, key: Key) -> None:
        if key in self._pending:
            self._pending.discard(key)
        else:
            self._sketch.record(key)
        self._inner.insert(key)

    def insert_many(self, keys: Sequence[Key]) -> None:
        pending = self._pending
        if pending:
            fresh = [k for k in keys if k not in pending]
            pending.difference_update(keys)
        else:
            fresh = keys
        if len(fresh) == 1:
            self._sketch.record(fresh[0])
        elif fresh:
            self._sketch.record_many(fresh)
        self._inner.insert_many(keys)

    def insert_cold_many(self, keys: Sequence[Key]) -> None:
        # Not recorded: no one asked for them (the sketch rates accesses).
        self._pending.difference_update(keys)
        self._inner.insert_cold_many(keys)

    def touch(self, key: Key) -> None:
        if key in self._inner:
            self._sketch.record(key)
            self._inner.touch(key)

    def touch_many(self, keys: Sequence[Key]) -> None:
        self._sketch.record_many(keys)
        self._inner.touch_many(keys)

    def remove(self, key: Key) -> None:
        self._pending.discard(key)
        self._inner.remove(key)

    def evict_these(self, keys: Sequence[Key]) -> None:
        self._pending.difference_update(keys)
        self._inner.evict_these(keys)

    def expect(self, child: Key, parent: Key) -> None:
        self._inner.expect(child, parent)

    def evict(self, n: int, protected: Protected, park: bool = False) -> list[Key]:
        return self._inner.evict(n, protected, park)

    @property
    def parked(self) -> Container[Key]:
        return self._inner.parked

    def unpark(self, keys: Sequence[Key]) -> None:
        self._inner.unpark(keys)

    def admitter(self, protected: Protected) -> Callable[[Key], bool]:
        """Each admitted candidate displaces the next victim from the LRU end:
        comparing a whole request with the first victim only let 7 warm
        blocks past one cold victim and evict 6 hot ones behind it."""
        victims = self._inner.victims(protected)
        victim = next(victims, None)

        def admit(candidate: Key) -> bool:
            nonlocal victim
            # A miss is an access too: without counting it, a key first seen
            # while the pool is full could never out-count the residents.
            self._sketch.record(candidate)
            if victim is not None and not self._sketch.admit(candidate, victim):
                return False
            if len(self._pending) >= _MAX_PENDING:
                self._pending.clear()
            self._pending.add(candidate)
            victim = next(victims, None)
            return True

        return admit

    def victims(self, protected: Protected) -> Iterator[Key]:
        return self._inner.victims(protected)

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, key: object) -> bool:
        return key in self._inner
