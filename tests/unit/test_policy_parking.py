"""LRUPolicy parks the pinned keys an eviction pass passes over: each is
looked at once per pin, not once per pass (pegaflow.cache.slot_eviction),
and comes back where LRU order puts it."""

from __future__ import annotations

from pegaflow.cache.eviction import AdmissionPolicy, Key, LRUPolicy, TinyLFU
from pegaflow.cache.miss_reasons import HitRateTracker, RecordingPolicy


def lru_with(*keys: Key) -> LRUPolicy:
    policy = LRUPolicy()
    policy.insert_many(list(keys))
    return policy


def counting(pinned: set[Key]) -> tuple[list[Key], object]:
    seen: list[Key] = []

    def protected(key: Key) -> bool:
        seen.append(key)
        return key in pinned

    return seen, protected


def test_a_pass_parks_the_pinned_keys_it_passes_and_never_looks_again() -> None:
    policy = lru_with("a", "b", "c", "d", "e")
    seen, protected = counting({"a", "b"})
    assert policy.evict(1, protected, park=True) == ["c"]
    assert seen == ["a", "b", "c"]
    assert set(policy.parked) == {"a", "b"}
    assert len(policy) == 4 and "a" in policy and "c" not in policy
    seen.clear()
    assert policy.evict(1, protected, park=True) == ["d"]
    assert seen == ["d"]


def test_without_park_a_pass_only_skips() -> None:
    """Another predicate than "pinned" (SlotEviction._evict_own's other
    classes) would never be unparked: those keys stay in the order."""
    policy = lru_with("a", "b", "c")
    seen, protected = counting({"a"})
    assert policy.evict(1, protected) == ["b"]
    assert not policy.parked
    seen.clear()
    assert policy.evict(1, protected) == ["c"]
    assert seen == ["a", "c"]


def test_an_unparked_key_returns_at_the_lru_end_unless_touched_meanwhile() -> None:
    policy = lru_with("a", "b", "c", "d")
    _, protected = counting({"a", "b"})
    assert policy.evict(1, protected, park=True) == ["c"]
    policy.insert("e")
    policy.touch_many(["b", "d"])  # b is parked: a hit while leased
    policy.unpark(["a", "b", "e"])  # e was never parked: nothing to do
    assert not policy.parked
    assert policy.evict(4, lambda k: False) == ["a", "e", "d", "b"]


def test_a_parked_key_removed_or_reinserted_leaves_the_parked_set() -> None:
    policy = lru_with("a", "b", "c")
    _, protected = counting({"a", "b", "c"})
    assert policy.evict(1, protected, park=True) == []
    policy.remove("a")
    policy.evict_these(["b"])
    policy.insert_many(["c"])  # published again: back in the order
    assert not policy.parked
    assert len(policy) == 1
    assert policy.evict(1, lambda k: False) == ["c"]


def test_wrappers_park_through_to_the_lru_order() -> None:
    inner = LRUPolicy()
    policy = RecordingPolicy(
        AdmissionPolicy(inner, TinyLFU(16)), HitRateTracker(1 << 10)
    )
    policy.insert_many(["a", "b", "c"])
    _, protected = counting({"a"})
    assert policy.evict(1, protected, park=True) == ["b"]
    assert policy.parked is inner.parked and "a" in policy.parked
    policy.touch("a")
    policy.unpark(["a"])
    assert policy.evict(2, lambda k: False) == ["c", "a"]


def test_a_pass_over_nothing_but_pinned_keys_parks_them_all() -> None:
    """The pool all but leased: the order is parked whole (merged with what
    was parked before), and comes back as LRU order says."""
    policy = lru_with("a", "b", "c")
    _, protected = counting({"a", "b", "c", "d", "e"})
    assert policy.evict(1, protected, park=True) == []
    policy.insert_many(["d", "e"])
    assert policy.evict(2, protected, park=True) == []
    assert set(policy.parked) == {"a", "b", "c", "d", "e"} and len(policy) == 5
    seen, _ = counting(set())
    policy.touch_many(["a"])
    policy.unpark(["e", "a", "c"])
    assert policy.evict(5, lambda k: seen.append(k) or False) == ["e", "c", "a"]
    assert set(policy.parked) == {"b", "d"}
