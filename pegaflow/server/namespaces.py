"""When a namespace's metadata goes: freed once empty, bounded while idle.

A namespace is empty when no registered worker uses it and the store holds no
entry of it: no block resident, none in flight (a save, an SSD load) and none
leased (a lease pins entries, which the store counts; LeaseTable is asked too).
Then everything the server keeps for it goes: the registry entry, the store's
per-namespace index (BlockStore drops it with the last entry), the hit-rate
state and with it the namespace's /metrics series, and the SSD link's cached
mapping. Its SSD blocks stay on disk: they are keyed by a digest of the name
and geometry, so the namespace registered again (under a new id: ids are never
reused) finds them.

Idle namespaces (no worker, blocks still resident) keep their registry entry
and block index (~25 KiB): an engine that comes back loads those blocks
through them, and their number is bounded by the pool, since each holds a
resident block. What grows with their number and not with the pool is the
hit-rate state: three HLL windows of 15 sub-windows of 64 KiB each, touched as
queries land, plus the merge each keeps for /metrics: ~0.4 MiB for a namespace
queried once, ~3 MiB after a day of queries, and 22 /metrics series (1.7 KB).
Past `max_idle` idle namespaces (--max-idle-namespaces, 16) the one idle the
longest loses it (and its SSD mapping, recomputed on demand): with the old
default of 4096, idle namespaces of one block each held ~785 KiB apiece and
400 of them made /metrics 715 KB (issue 30 #5). A namespace that lost its
state counts from zero if an engine returns; the blocks themselves leave by
eviction, and with the last of them the namespace.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Registry
from pegaflow.cache.leases import LeaseTable
from pegaflow.cache.miss_reasons import HitRateTracker
from pegaflow.cache.store_events import StoreListener
from pegaflow.common.keys import Namespace
from pegaflow.tiers.protocol import Tier

logger = logging.getLogger(__name__)


class NamespaceReaper(StoreListener):
    """Told when a worker joins or leaves a namespace; hears from the store
    when a namespace's last block goes. All calls on the event loop."""

    def __init__(
        self,
        registry: Registry,
        store: BlockStore,
        leases: LeaseTable,
        hit_rates: HitRateTracker,
        tiers: list[Tier],
        max_idle: int,
    ) -> None:
        self._registry = registry
        self._store = store
        self._leases = leases
        self._hit_rates = hit_rates
        self._tiers = tiers  # the engine's list: tiers added later are told too
        self._max_idle = max_idle
        # Idle namespaces, the longest idle first.
        self._idle: OrderedDict[int, Namespace] = OrderedDict()
        store.add_listener(self)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def joined(self, ns: Namespace) -> None:
        """A worker registered in ns."""
        self._idle.pop(ns.id, None)

    def left(self, ns: Namespace) -> None:
        """A worker of ns unregistered: free ns if that was its last user and
        nothing of it is left, else count it idle."""
        if self._in_use(ns) or self._release(ns):
            return
        self._idle[ns.id] = ns
        self._idle.move_to_end(ns.id)
        while len(self._idle) > self._max_idle:
            _, oldest = self._idle.popitem(last=False)
            self._forget(oldest)
            logger.debug("namespace %s: idle too long, hit rates dropped", oldest.tag)

    def emptied(self, ns: Namespace) -> None:
        """The store's last entry of ns went (evicted, dropped, failed)."""
        if not self._in_use(ns):
            self._release(ns)

    def _in_use(self, ns: Namespace) -> bool:
        return any(
            inst.workers and inst.namespace is ns
            for inst in self._registry.instances.values()
        )

    def _release(self, ns: Namespace) -> bool:
        if self._store.holds(ns.id) or self._leases.held_in(ns.id):
            return False
        if not self._registry.release_namespace(ns):
            return False
        self._idle.pop(ns.id, None)
        self._forget(ns)
        logger.debug("namespace %s freed", ns.tag)
        return True

    def _forget(self, ns: Namespace) -> None:
        self._hit_rates.forget(ns.id)
        for tier in self._tiers:
            tier.forget(ns.id)
