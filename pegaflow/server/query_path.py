"""The prefix query: L1's ready index first, then the lower tiers in order
(pegaflow.tiers.protocol: the SSD, or a peer through the metaserver), answering
`ready` with a lease or `loading`; and the hit-rate log of every answer."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.instances import Instance, Registry
from pegaflow.cache.leases import DirectRead, LeaseTable
from pegaflow.cache.miss_reasons import HitRateTracker
from pegaflow.common import deadlines
from pegaflow.common.errors import InvalidRequest, PermissionDenied
from pegaflow.common.identity import UNKNOWN, CallContext
from pegaflow.common.keys import MAX_HASH_BYTES, BlockHash, Namespace, PackedHashes
from pegaflow.common.results import QueryResult
from pegaflow.tiers.protocol import Lookup, Tier

from .metrics import Metrics


def check_hashes(
    hashes: list[BlockHash], limit: int, hash_len: int | None = None
) -> None:
    """Count and lengths; hash_len skips the scan when every length is known."""
    if len(hashes) > limit:
        raise InvalidRequest(f"block_hashes: {len(hashes)} exceeds {limit}")
    if not hashes:
        return
    lengths = [hash_len] if hash_len is not None else list(map(len, hashes))
    if min(lengths) < 1 or max(lengths) > MAX_HASH_BYTES:
        i = next(i for i, n in enumerate(lengths) if not 0 < n <= MAX_HASH_BYTES)
        raise InvalidRequest(
            f"block_hashes[{i}]: {lengths[i]} bytes, need 1..{MAX_HASH_BYTES}"
        )


class PrefixQueries:
    """The engine's query path; it reads the registry, store, tiers, leases
    and counters, and changes only leases and the hit-rate log."""

    def __init__(
        self,
        registry: Registry,
        store: BlockStore,
        tiers: list[Tier],
        leases: LeaseTable,
        hit_rates: HitRateTracker,
        metrics: Metrics,
        max_blocks: int,
        load_gbps: Callable[[Instance], float] = lambda _: 0.0,
    ) -> None:
        """tiers: the server's lower tiers in query order (the list is the
        engine's: tiers added later are walked too). load_gbps: the recent
        rate of an instance's loads from L1."""
        self._registry = registry
        self._store = store
        self._tiers = tiers
        self._leases = leases
        self._hit_rates = hit_rates
        self._metrics = metrics
        self._max_blocks = max_blocks
        self._load_gbps = load_gbps
        # Hits counted per medium beside the hit rates (only the SSD's has one).
        self._tier_hits = {"ssd": metrics.ssd_hits}

    def query(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        hash_len: int | None = None,
        ctx: CallContext | None = None,
    ) -> QueryResult:
        """hashes: a list (gRPC) or a fast-path frame's packed run, which stays
        packed unless a miss needs the SSD tier. hash_len: the length every
        hash is known to have (a fast-path frame). A query needs no owner
        token (vLLM's scheduler asks for its workers), but a caller the kernel
        names must run as the instance's user."""
        inst = self.admit(instance_id, len(hashes), ctx)
        if isinstance(hashes, PackedHashes):
            hash_len = hashes.hash_len
        check_hashes(hashes, self._max_blocks, hash_len)
        ns = inst.namespace
        hits, rest = self._store.lookup(ns, hashes)
        if not len(rest) or not self._tiers:
            return self._answer(instance_id, hashes, hits, rest, hash_len)
        listed = hashes.list() if isinstance(hashes, PackedHashes) else hashes
        for tier in self._tiers:  # in order; the first that is not a miss decides
            look = self._look(tier, inst, listed, hits)
            if look.state == "hit":  # read into the engine's blocks at its load
                direct = listed[len(hits) : len(hits) + look.blocks]
                return self._answer(
                    instance_id, hashes, hits, rest, hash_len, tier, direct, look.read
                )
            if look.state == "loading":
                if look.started:
                    self._count_loading(ns, hashes, hits, rest, hash_len, tier, look)
                return self._loading(inst, len(hits), tier, look)
            if look.state == "asking":  # the boundary awaits the rest
                ask = functools.partial(
                    self._asked, instance_id, hashes, listed, hash_len, tier, look
                )
                return QueryResult(0, 0, 0.0, pending=ask)
        return self._answer(instance_id, hashes, hits, rest, hash_len)

    def admit(
        self, instance_id: str, count: int, ctx: CallContext | None = None
    ) -> Instance:
        """What a query is checked for before its hashes are looked at (or,
        off the wire, built: pegaflow.server.query_wire): the instance, the
        deadline, the caller's user and the number of hashes."""
        inst = self._registry.instance(instance_id)
        if ctx is not None:
            deadlines.check(ctx.deadline, "query")
            uid = ctx.caller.uid
            if UNKNOWN not in (uid, inst.owner_uid) and uid not in (0, inst.owner_uid):
                raise PermissionDenied(
                    f"instance_id: {instance_id!r} belongs to another user (uid "
                    f"{inst.owner_uid}); the caller is uid {uid}"
                )
        if count > self._max_blocks:
            raise InvalidRequest(f"block_hashes: {count} exceeds {self._max_blocks}")
        return inst

    def _look(
        self, tier: Tier, inst: Instance, listed: list[BlockHash], hits: list
    ) -> Lookup:
        if not tier.evicts_on_lookup:
            return tier.lookup(inst, listed, len(hits))
        # Pinned meanwhile: finding room for the tier's blocks must not evict
        # the very hits this query is about to lease.
        self._store.pin(hits)
        try:
            return tier.lookup(inst, listed, len(hits))
        finally:
            self._store.unpin(hits)

    async def _asked(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        listed: list[BlockHash],
        hash_len: int | None,
        tier: Tier,
        asking: Lookup,
    ) -> QueryResult:
        """The rest of a query a tier had to ask elsewhere about (a peer's
        blocks: the metaserver's plan)."""
        assert asking.ask is not None
        inst = self._registry.instance(instance_id)
        ns = inst.namespace
        hits, rest = self._store.lookup(ns, hashes)  # again: the loop ran meanwhile
        if len(rest):
            look = await asking.ask(ns, listed, len(hits))
            if look.state == "loading":
                if look.started:
                    self._count_loading(ns, hashes, hits, rest, hash_len, tier, look)
                return self._loading(inst, len(hits), tier, look)
            if self._registry.instance(instance_id).namespace is not ns:
                # Re-registered (another geometry, perhaps) while we awaited:
                # nothing found under the old namespace may be leased to it.
                return QueryResult(0, 0, 0.0)
            hits, rest = self._store.lookup(ns, hashes)  # and again after the await
        return self._answer(instance_id, hashes, hits, rest, hash_len)

    def _loading(
        self, inst: Instance, ready: int, tier: Tier, look: Lookup
    ) -> QueryResult:
        return QueryResult(
            look.blocks,
            0,
            0.0,
            loading=True,
            ready_blocks=ready,
            l1_gbps=self._load_gbps(inst),
            tier_gbps=tier.rate.gbps,
        )

    def _count_loading(
        self,
        ns: Namespace,
        hashes: list[BlockHash] | PackedHashes,
        hits: list[BlockEntry],
        rest: np.ndarray,
        hash_len: int | None,
        tier: Tier,
        look: Lookup,
    ) -> None:
        """Counted once, when the load starts: the engine's polls while it runs
        are waits, not new requests; its final ready answer counts as usual."""
        n = look.blocks
        total = len(hits) + n
        self._hit_rates.query(ns, hashes, total, rest[n:], hash_len, **{tier.medium: n})
        self._count_tier_hits(tier, n)

    def _count_tier_hits(self, tier: Tier | None, n: int) -> None:
        counter = self._tier_hits.get(tier.medium) if tier is not None else None
        if counter is not None and n:
            counter.inc(n)

    def _answer(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        hits: list[BlockEntry],
        rest: np.ndarray,
        hash_len: int | None,
        tier: Tier | None = None,
        direct: list[BlockHash] | None = None,
        read: DirectRead | None = None,
    ) -> QueryResult:
        """direct: the tier's blocks after the hits, leased for `read` into
        the engine's blocks at its load (pegaflow.tiers.ssd_gpu_direct)."""
        inst = self._registry.instance(instance_id)
        ns = inst.namespace
        n = len(direct) if direct else 0
        by_tier = {tier.medium: n} if tier is not None else {}
        self._hit_rates.query(ns, hashes, len(hits) + n, rest[n:], hash_len, **by_tier)
        self._metrics.hits.inc(len(hits))
        self._count_tier_hits(tier, n)
        self._metrics.misses.inc(len(hashes) - len(hits) - n)
        l1_gbps = self._load_gbps(inst)
        if not hits and not n:
            return QueryResult(0, 0, 0.0, l1_gbps=l1_gbps)
        fits = self._leases.room(inst.owner_uid, ns.block_bytes, len(hits))
        if fits < len(hits):  # the user's leases pin their part of the bound
            self._metrics.lease_capped.inc(len(hits) - fits + n)
            hits, direct, read, n = hits[:fits], None, None, 0
            if not hits:
                return QueryResult(0, 0, 0.0, l1_gbps=l1_gbps)
        lease = self._leases.create(
            instance_id,
            ns.id,
            hits,
            inst.world_size,
            direct,
            read,
            user=inst.owner_uid,
            block_bytes=ns.block_bytes,
        )
        return QueryResult(len(hits) + n, lease.id, self._leases.ttl_s, l1_gbps=l1_gbps)
