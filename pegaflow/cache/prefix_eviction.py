"""Prefix-aware eviction: chain tails leave before the blocks they extend.

A query stops at the first missing block, so a block is worth as much as the
blocks chained after it, and evicting a chain's head throws the rest away.
`PrefixLRUPolicy` is LRU over chain *leaves*: a key that a resident key claims
as its parent is deferred when the scan reaches it, and comes back at the LRU
end when its last child is gone, so it leaves right after its descendants
(its effective recency is its newest descendant's). Keys enter at the MRU end
tail first, so one request's chain is evicted tail first without deferring.

Parents are learned from the order a request's keys arrive (vLLM's hashes are
chained: block i's parent is block i-1):
- a save's keys, in request order (`insert_many`);
- a query's hit prefix (`touch_many`): exact, it is one request's chain;
- a query's first missing block extends its last hit (`expect`): the save that
  follows starts there. Expectations live in a bounded map until the save.

Links are claims from a client, never trusted to pin a block:
- acyclic by construction: a link child -> parent is kept only if the parent
  entered before the child (an insertion number fixed while resident), so a
  deferred key's resident descendants are finite and their leaves evictable;
- one parent per key and links between resident keys only: memory is
  O(resident keys) plus the bounded expectations;
- where every leaf is protected (leased, in flight), `evict` falls back to
  deferred keys, oldest deferral first: it succeeds whenever LRU's would.
A save batching several requests claims one false link at each boundary
between them; it only defers one block until the next request's chain goes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from functools import partial
from itertools import chain, compress, islice, repeat
from operator import is_, is_not, itemgetter, setitem

from pegaflow.common.settings import EVICTION_SETTINGS, EvictionSetting

from .eviction import (
    AdmissionPolicy,
    EvictionPolicy,
    Key,
    LRUPolicy,
    Protected,
    TinyLFU,
)

# Queries' expected links not yet saved; past this the map starts afresh (the
# saves they announced came long ago or never: a forgotten one is one link).
MAX_EXPECTED = 1 << 16

# A resident key's node, a list so that C-level passes (itemgetter, setitem)
# read and write it with no hashing of the key: [insertion number, live
# children, parent node or None, key, state]. One incarnation per residency:
# a child linked to an evicted parent points at a dead node, never counted.
Node = list
SEQ, KIDS, UP, KEY, STATE = range(5)
IN_ORDER, DEFERRING, DEFERRED, GONE = range(4)
_kids_of, _up_of = itemgetter(KIDS), itemgetter(UP)
_key_of = itemgetter(KEY)


class PrefixLRUPolicy:
    """LRU over leaves of the claimed chains; see the module docstring."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, Node] = OrderedDict()  # LRU first
        # Keys the scan met with live children, oldest deferral first.
        self._deferred: OrderedDict[Key, Node] = OrderedDict()
        self._expected: dict[Key, Key] = {}  # child to come -> its parent
        self._seq = 1

    # --- entering and touching -------------------------------------------
    def insert(self, key: Key) -> None:
        if key in self:
            self.touch(key)
            return
        node = self._order[key] = [self._seq, 0, None, key, IN_ORDER]
        self._seq += 1
        if self._expected:
            claimed = self._expected.pop(key, None)
            if claimed is not None:
                self._link(node, self._node(claimed))

    def insert_many(self, keys: Sequence[Key]) -> None:
        """A save's newly ready keys, in request order: key i extends key i-1.
        The store sends keys not resident (a block is made ready once)."""
        order, deferred, n = self._order, self._deferred, len(keys)
        if not n:
            return
        if deferred and not deferred.keys().isdisjoint(keys):
            for key in keys:
                self.insert(key)
            return
        kids = chain(repeat(1, n - 1), (0,))
        seqs = range(self._seq, self._seq + n)
        self._seq += n
        nodes = list(map(list, zip(seqs, kids, repeat(None), keys, repeat(0))))
        deque(map(setitem, islice(nodes, 1, None), repeat(UP), nodes), maxlen=0)
        before = len(order)
        # Tail first: the chain's last key is the least recent of them.
        order.update(zip(reversed(keys), reversed(nodes), strict=True))
        if len(order) - before != n:  # some were resident: count afresh
            self._recount()
        if self._expected:
            claims = list(map(self._expected.pop, keys, repeat(None)))
            for i in compress(range(n), claims):
                if i == 0 or claims[i] != keys[i - 1]:
                    self._link(nodes[i], self._node(claims[i]))

    def insert_cold_many(self, keys: Sequence[Key]) -> None:
        """Keys one by one: nothing says they form a chain (a restart's
        recovered blocks, in the file's row order)."""
        for key in keys:
            self.insert(key)
        move = partial(self._order.move_to_end, last=False)
        deque(map(move, reversed(keys)), maxlen=0)

    def touch(self, key: Key) -> None:
        node = self._deferred.pop(key, None)
        if node is not None:
            node[STATE] = IN_ORDER
            self._order[key] = node
        if key in self._order:
            self._order.move_to_end(key)

    def touch_many(self, keys: Sequence[Key]) -> None:
        """A query's hit prefix, head first: all resident, one chain."""
        order, deferred = self._order, self._deferred
        if deferred:
            for key in list(filter(deferred.__contains__, keys)):
                node = order[key] = deferred.pop(key)
                node[STATE] = IN_ORDER
        nodes = list(map(order.__getitem__, keys))
        deque(map(order.move_to_end, reversed(keys)), maxlen=0)
        if len(nodes) < 2:
            return
        if not all(map(is_, map(_up_of, islice(nodes, 1, None)), nodes)):
            ups = list(map(_up_of, islice(nodes, 1, None)))
            for i in compress(range(1, len(nodes)), map(is_not, ups, nodes)):
                self._link(nodes[i], nodes[i - 1])  # a frame per new link only

    def expect(self, child: Key, parent: Key) -> None:
        """A query's claim: `child`, not resident yet, extends resident `parent`."""
        expected = self._expected
        if len(expected) >= MAX_EXPECTED:
            expected.clear()
        expected[child] = parent

    def remove(self, key: Key) -> None:
        node = self._order.pop(key, None)
        if node is None:
            node = self._deferred.pop(key, None)
            if node is None:
                return
        self._bury([node], [node[UP]])

    def evict_these(self, keys: Sequence[Key]) -> None:
        for key in keys:
            self.remove(key)

    # --- links --------------------------------------------------------------
    def _node(self, key: Key) -> Node | None:
        node = self._order.get(key)
        return self._deferred.get(key) if node is None else node

    def _link(self, child: Node, parent: Node | None) -> None:
        """Count `parent` as extended by `child` if it entered before the
        child: insertion numbers only grow along links, so there is no cycle."""
        if parent is None or parent[SEQ] >= child[SEQ] or child[UP] is parent:
            return
        old = child[UP]
        if old is not None:
            self._unlink(old)
        child[UP] = parent
        parent[KIDS] += 1

    def _unlink(self, parent: Node) -> None:
        """One child of `parent` is gone; a deferred parent left with none goes
        next (its newest descendant just left)."""
        if parent[STATE] == GONE or not parent[KIDS]:
            return
        parent[KIDS] -= 1
        if not parent[KIDS] and parent[STATE] == DEFERRED:
            self._revive(parent)

    def _revive(self, node: Node) -> None:
        key = node[KEY]
        self._order[key] = self._deferred.pop(key)
        self._order.move_to_end(key, last=False)
        node[STATE] = IN_ORDER

    def _bury(self, nodes: list[Node], ups: Iterable[Node | None] = ()) -> None:
        """Nodes out of the dicts: dead, then `ups` (their parents that lost
        a child) told, and no references kept (a dead node holds no chain of
        dead nodes alive)."""
        deque(map(setitem, nodes, repeat(STATE), repeat(GONE)), maxlen=0)
        deque(map(setitem, nodes, repeat(UP), repeat(None)), maxlen=0)
        for up in ups:
            if up is not None and up[STATE] != GONE:
                self._unlink(up)

    def _recount(self) -> None:
        """Children counted from the links again (after a key was inserted
        while resident, against the store's contract)."""
        live = list(chain(self._order.values(), self._deferred.values()))
        for node in live:
            node[KIDS] = 0
        for node in live:
            up = node[UP]
            if up is not None:
                if up[STATE] == GONE or self._node(up[KEY]) is not up:
                    node[UP] = None
                else:
                    up[KIDS] += 1
        for node in list(self._deferred.values()):
            if not node[KIDS]:
                self._revive(node)

    # --- choosing victims ------------------------------------------------------
    # Pinned keys are not parked here: the scan passes over them each time
    # (a leaf's deferral and revival would have to follow it out and back).
    parked: Container[Key] = frozenset()

    def unpark(self, keys: Sequence[Key]) -> None:
        pass

    def evict(self, n: int, protected: Protected, park: bool = False) -> list[Key]:
        if n < 0:
            raise ValueError(f"evict: n must be >= 0, got {n}")
        if n == 0:
            return []
        fast = self._evict_tails(n, protected)
        return fast if fast is not None else self._evict_scan(n, protected)

    def _evict_tails(self, n: int, protected: Protected) -> list[Key] | None:
        """The common case in C-level passes: the n least recent keys, none
        protected, each with every child among them (chains entered tail
        first, a child right before its parent). None: scan instead."""
        nodes = list(islice(self._order.values(), n))
        if len(nodes) < n:
            return None
        keys = list(map(_key_of, nodes))
        if any(map(protected, keys)):
            return None
        ups = list(map(_up_of, nodes))
        # Children counted on these nodes >= child-parent pairs among them >=
        # the adjacent ones; equal only if every child is among them.
        if sum(map(_kids_of, nodes)) > sum(map(is_, ups, islice(nodes, 1, None))):
            return None
        deque(map(self._order.__delitem__, keys), maxlen=0)
        # No live node points at these (every child is among them), so they
        # need no burying. Parents outside the n: not the next node's.
        outside = compress(ups, map(is_not, ups, islice(nodes, 1, None)))
        for up in [*outside, ups[-1]]:
            if up is not None and up[STATE] != GONE:
                self._unlink(up)
        return keys

    def _evict_scan(self, n: int, protected: Protected) -> list[Key]:
        """From the LRU end: leaves go, keys with live children are deferred
        and come back right after their last child; if every leaf is
        protected, deferred keys go, oldest deferral first. One pass: up to
        n, every unprotected key where fewer are."""
        victims: list[Key] = []
        taken: list[Node] = []
        deferring: list[Node] = []  # met with live children in this call
        revived: list[Node] = []  # deferred parents left childless: next
        held: list[Node] = []  # of those, the protected ones
        for key, node in self._order.items():
            if protected(key):
                continue
            if node[KIDS]:
                node[STATE] = DEFERRING
                deferring.append(node)
                continue
            self._take(node, victims, taken, revived)
            while revived and len(victims) < n:  # a parent right after its tail
                up = revived.pop()
                if protected(up[KEY]):
                    held.append(up)
                else:
                    self._take(up, victims, taken, revived)
            if len(victims) == n:
                break
        scanned = len(victims)  # leaves; any after them are the fallback's
        if scanned < n:  # every leaf protected: defer no longer
            chosen = set(victims)
            rest = chain(self._deferred.values(), deferring)
            for node in rest:
                if node[KEY] not in chosen and not protected(node[KEY]):
                    victims.append(node[KEY])
                    taken.append(node)
                    if len(victims) == n:
                        break
        self._commit(victims, taken, scanned, deferring, revived + held)
        return victims

    @staticmethod
    def _take(
        node: Node,
        victims: list[Key],
        taken: list[Node],
        revived: list[Node],
    ) -> None:
        victims.append(node[KEY])
        taken.append(node)
        up = node[UP]
        if up is not None and up[KIDS] and up[STATE] != GONE:
            up[KIDS] -= 1
            if not up[KIDS] and up[STATE] != IN_ORDER:  # deferred, or in this call
                revived.append(up)

    def _commit(
        self,
        victims: list[Key],
        taken: list[Node],
        scanned: int,
        deferring: list[Node],
        childless: list[Node],
    ) -> None:
        """Apply the scan's choice: taken[:scanned] were leaves, their parents
        counted off already; the rest the fallback's. `childless`: deferred
        nodes left with no child and not taken (protected, or past n)."""
        order, deferred = self._order, self._deferred
        deque(map(order.pop, victims, repeat(None)), maxlen=0)
        if deferred:
            deque(map(deferred.pop, victims, repeat(None)), maxlen=0)
        # The leaves' parents were counted off by the scan; the fallback's not.
        self._bury(taken, list(map(_up_of, islice(taken, scanned, None))))
        for node in childless:  # next in line
            if node[STATE] == DEFERRED and not node[KIDS]:
                self._revive(node)
        for node in deferring:
            if node[STATE] != DEFERRING:
                continue
            if node[KIDS]:
                node[STATE] = DEFERRED
                deferred[node[KEY]] = order.pop(node[KEY])
            else:
                node[STATE] = IN_ORDER

    def admitter(self, protected: Protected) -> Callable[[Key], bool]:
        return _admit_all

    def victims(self, protected: Protected) -> Iterator[Key]:
        """Unprotected keys in about the order evict takes them (leaves first,
        deferred keys last), lazily; valid while nothing changes."""
        leaves = (
            k for k, node in self._order.items() if not node[KIDS] and not protected(k)
        )
        rest = (k for k in self._deferred if not protected(k))
        return chain(leaves, rest)

    def __len__(self) -> int:
        return len(self._order) + len(self._deferred)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._deferred


def _admit_all(candidate: Key) -> bool:
    return True


def make_policy(kind: EvictionSetting, admission_capacity: int = 0) -> EvictionPolicy:
    """The server's policy: LRU or prefix-aware, behind TinyLFU admission when
    `admission_capacity` (about the pool's blocks) is > 0."""
    if kind not in EVICTION_SETTINGS:
        raise ValueError(f"eviction: {kind!r} is not one of {EVICTION_SETTINGS}")
    inner: EvictionPolicy = PrefixLRUPolicy() if kind == "prefix" else LRUPolicy()
    if admission_capacity > 0:
        return AdmissionPolicy(inner, TinyLFU(admission_capacity))
    return inner
