"""PrefixLRUPolicy: chain tails before their parents, within LRU order; claims
that cannot pin a block; atomic eviction; the same through the block store and
behind TinyLFU admission."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pegaflow.cache import prefix_eviction
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import AdmissionPolicy, LRUPolicy
from pegaflow.cache.prefix_eviction import PrefixLRUPolicy, make_policy
from pegaflow.cache.slabs import SlabAllocator
from pegaflow.common.keys import Key, Namespace
from pegaflow.common.settings import EngineConfig


def unprotected(key: Key) -> bool:
    return False


def drain(policy: PrefixLRUPolicy | LRUPolicy | AdmissionPolicy) -> list:
    out = []
    while len(policy):
        out += policy.evict(1, unprotected)
    return out


def vllm_order(policy: PrefixLRUPolicy | LRUPolicy | AdmissionPolicy) -> None:
    """Chain a-b-c-d as vLLM sends it: a, b saved; a query hits them and
    misses c; c, d saved. Then x, unrelated."""
    policy.insert_many(["a", "b"])
    policy.expect("c", "b")
    policy.touch_many(["a", "b"])
    policy.insert_many(["c", "d"])
    policy.insert("x")


def test_tails_go_before_the_blocks_they_extend() -> None:
    """LRU takes the chain's head first (the query touched it before its tail
    was saved), which leaves c and d unreachable; prefix-aware eviction takes
    d, c, b, a: the chain stays a prefix at every step."""
    lru, prefix = LRUPolicy(), PrefixLRUPolicy()
    vllm_order(lru)
    vllm_order(prefix)
    assert drain(lru) == ["a", "b", "c", "d", "x"]
    assert drain(prefix) == ["d", "c", "b", "a", "x"]


def test_a_deferred_parent_waits_for_its_newest_child_then_goes_next() -> None:
    """p is older than x, but its child c is newer: x goes first (LRU order
    among leaves), then c, then p before anything newer than p's child."""
    policy = PrefixLRUPolicy()
    policy.insert("p")
    policy.insert("x")
    policy.insert("c")
    policy.touch_many(["p", "c"])  # a query's prefix: c extends p
    policy.insert("y")
    policy.touch("y")
    policy.touch("c")  # c (and so p) now newer than y
    assert drain(policy) == ["x", "y", "c", "p"]


def test_protected_leaves_do_not_make_eviction_fail() -> None:
    """Every leaf leased: the parents they keep are taken instead (as LRU would
    succeed), and the leased keys never."""
    policy = PrefixLRUPolicy()
    policy.insert_many(["a", "b", "c"])
    leased = {"c"}
    assert policy.evict(2, leased.__contains__) == ["b", "a"]
    assert policy.evict(1, leased.__contains__) == []
    assert "c" in policy and len(policy) == 1


def test_fewer_unprotected_than_asked_go_in_one_pass() -> None:
    """Fewer unprotected keys than asked: every one, in the order a request
    for exactly that many takes them; the protected stay, links intact."""
    policy = PrefixLRUPolicy()
    vllm_order(policy)
    leased = {"a", "x"}
    assert policy.evict(4, leased.__contains__) == ["d", "c", "b"]
    assert len(policy) == 2
    assert policy.evict(4, leased.__contains__) == []
    assert drain(policy) == ["a", "x"]


def test_claims_cannot_pin_blocks() -> None:
    """Lies: a cycle (b extends a, then a extends b), a parent newer than its
    child, a claim on keys not resident. None of them keeps a key from being
    evicted in LRU order of its leaves."""
    policy = PrefixLRUPolicy()
    policy.insert_many(["a", "b"])  # b extends a
    policy.touch_many(["b", "a"])  # a extends b? refused: b entered after a
    policy.insert("old")
    policy.insert("new")
    policy.touch_many(["new", "old"])  # old extends new? refused likewise
    policy.expect("gone", "never-saved")
    policy.insert("gone")  # its claimed parent is not resident: no link
    assert policy.evict(5, unprotected) == ["b", "a", "old", "new", "gone"]
    assert len(policy) == 0


def test_expectations_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that queries and never saves costs a bounded map."""
    monkeypatch.setattr(prefix_eviction, "MAX_EXPECTED", 8)
    policy = PrefixLRUPolicy()
    for i in range(100):
        policy.expect(("child", i), ("parent", i))
        assert len(policy._expected) <= 8


def _check_invariants(policy: PrefixLRUPolicy, resident: set) -> None:
    """Every resident key in one dict with a live node; a live node's count
    is exactly its live children; a deferred key waits on one; dead nodes
    hold no references."""
    order, deferred = policy._order, policy._deferred
    assert not order.keys() & deferred.keys()
    assert order.keys() | deferred.keys() == resident
    live = {id(node): node for node in [*order.values(), *deferred.values()]}
    children: dict[int, int] = {}
    for node in live.values():
        up = node[prefix_eviction.UP]
        if up is not None and id(up) in live:
            assert up[prefix_eviction.SEQ] < node[prefix_eviction.SEQ]  # acyclic
            children[id(up)] = children.get(id(up), 0) + 1
        elif up is not None:
            assert up[prefix_eviction.STATE] == prefix_eviction.GONE
            assert up[prefix_eviction.UP] is None
    for node in live.values():
        assert node[prefix_eviction.KIDS] == children.get(id(node), 0)
    for node in order.values():
        assert node[prefix_eviction.STATE] == prefix_eviction.IN_ORDER
    for node in deferred.values():
        assert node[prefix_eviction.STATE] == prefix_eviction.DEFERRED
        assert node[prefix_eviction.KIDS] > 0


@pytest.mark.parametrize("seed", range(8))
def test_random_operations_keep_the_books(seed: int) -> None:
    """Random saves of chain pieces, queries of prefixes (with expectations),
    and evictions under random leases: evict succeeds exactly when LRU's
    would, returns distinct resident unprotected keys, and the links stay
    consistent and bounded."""
    rng = random.Random(seed)
    policy = PrefixLRUPolicy()
    resident: set = set()
    chains = [[(c, i) for i in range(40)] for c in range(6)]
    for _ in range(400):
        op = rng.random()
        chain = rng.choice(chains)
        if op < 0.4:
            lo = rng.randrange(len(chain))
            piece = [k for k in chain[lo : lo + rng.randrange(1, 8)]]
            piece = [k for k in piece if k not in resident]
            if rng.random() < 0.2:
                rng.shuffle(piece)  # a client lying about the order
            policy.insert_many(piece)
            resident.update(piece)
        elif op < 0.7:
            hit = 0
            while hit < len(chain) and chain[hit] in resident:
                hit += 1
            if hit:
                policy.touch_many(chain[:hit])
                if hit < len(chain):
                    policy.expect(chain[hit], chain[hit - 1])
        else:
            leased = set(rng.sample(sorted(resident), len(resident) // 3))
            n = rng.randrange(1, 6)
            victims = policy.evict(n, leased.__contains__)
            assert len(set(victims)) == len(victims) == min(n, len(resident - leased))
            assert set(victims) <= resident - leased
            resident -= set(victims)
        _check_invariants(policy, resident)


def test_behind_tinylfu_admission_the_order_is_the_same() -> None:
    wrapped = make_policy("prefix", admission_capacity=1024)
    assert isinstance(wrapped, AdmissionPolicy)
    vllm_order(wrapped)
    assert drain(wrapped) == ["d", "c", "b", "a", "x"]
    plain = make_policy("lru", admission_capacity=1024)
    vllm_order(plain)
    assert drain(plain) == ["a", "b", "c", "d", "x"]
    with pytest.raises(ValueError, match="eviction: 'lfu'"):
        make_policy("lfu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="eviction: 'lfu' is not one of lru"):
        EngineConfig(eviction="lfu")  # type: ignore[arg-type]


def _store(kind: str) -> tuple[BlockStore, Namespace]:
    slot = 4096
    ns = Namespace("ns", 1, 1, 1, slot, (1, slot))
    # 16 slots: one slab
    return BlockStore(
        SlabAllocator(1 << 40, 16 * slot, 16 * slot), make_policy(kind)
    ), ns


@pytest.mark.parametrize("kind", ["lru", "prefix"])
def test_block_store_feeds_the_chain(kind: str) -> None:
    """Through the store as the server runs it: 8 blocks saved, a query hits
    them and misses the 9th (its expectation), 8 more saved, then 4 others
    into the full pool. Prefix-aware eviction keeps a 12-block hit; LRU took
    the chain's head, so it hits nothing."""
    store, ns = _store(kind)
    layers = np.arange(1)
    chain = [bytes([i]) * 32 for i in range(16)]

    def save(hs: list[bytes]) -> None:
        store.finish_save(store.reserve_save(ns, 0, hs, layers), True)

    save(chain[:8])
    assert len(store.longest_prefix(ns, chain)) == 8
    save(chain[8:])
    save([bytes([100 + i]) * 32 for i in range(4)])
    assert store.counters.evictions == 4
    hit = len(store.longest_prefix(ns, chain))
    assert hit == (12 if kind == "prefix" else 0)


def test_remove_and_a_resident_key_saved_again_keep_the_books() -> None:
    """Against the store's contract (a block is made ready once), a key saved
    while resident gets a fresh node and the counts are rebuilt; a removed
    parent's children are leaves again in the books."""
    policy = PrefixLRUPolicy()
    policy.insert_many(["a", "b", "c"])
    policy.insert_many(["c", "d"])  # c again: d extends it
    _check_invariants(policy, {"a", "b", "c", "d"})
    policy.remove("b")
    policy.remove("missing")
    _check_invariants(policy, {"a", "c", "d"})
    policy.expect("e", "d")
    policy.insert("e")  # one block saved alone: the query's claim links it
    _check_invariants(policy, {"a", "c", "d", "e"})
    assert drain(policy) == ["a", "e", "d", "c"]
