"""The prefix query: L1's ready index first, then a slower tier that holds
the rest (the SSD, or a peer through the metaserver), answering `ready` with
a lease or `loading`; and the hit-rate log of every answer."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from pegaflow.cache.block_entry import BlockEntry
from pegaflow.common import deadlines
from pegaflow.common.errors import InvalidRequest, PermissionDenied
from pegaflow.common.identity import UNKNOWN, CallContext
from pegaflow.common.keys import MAX_HASH_BYTES, BlockHash, Namespace, PackedHashes
from pegaflow.common.results import QueryResult

if TYPE_CHECKING:
    from .engine import Engine


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
    """The engine's query path; it reads the engine's registry, store, tiers,
    leases and counters, and changes only leases and the hit-rate log."""

    def __init__(self, engine: Engine) -> None:
        self._e = engine

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
        inst = self._e.registry.instance(instance_id)
        if ctx is not None:
            deadlines.check(ctx.deadline, "query")
            uid = ctx.caller.uid
            if UNKNOWN not in (uid, inst.owner_uid) and uid not in (0, inst.owner_uid):
                raise PermissionDenied(
                    f"instance_id: {instance_id!r} belongs to another user (uid "
                    f"{inst.owner_uid}); the caller is uid {uid}"
                )
        if isinstance(hashes, PackedHashes):
            hash_len = hashes.hash_len
        check_hashes(hashes, self._e.config.max_blocks_per_request, hash_len)
        ns = inst.namespace
        hits, rest = self._e.store.lookup(ns, hashes)
        if len(rest) and (self._e.ssd is not None or self._e.remote is not None):
            listed = hashes.list() if isinstance(hashes, PackedHashes) else hashes
            direct = self._e.ssd_direct
            if direct is not None and direct.serves(inst):
                tail = direct.tail(ns, listed, len(hits))
                if tail:  # read into the engine's blocks at its load
                    return self._answer(instance_id, hashes, hits, rest, hash_len, tail)
            if self._e.ssd is not None:
                # Pinned meanwhile: finding room for the SSD blocks must not
                # evict the very hits this query is about to lease.
                self._e.store.pin(hits)
                try:
                    n, started = self._e.ssd.loading(ns, listed, len(hits))
                finally:
                    self._e.store.unpin(hits)
                if n:
                    if started:
                        self._count_loading(ns, hashes, hits, rest, hash_len, n, "ssd")
                    return QueryResult(n, 0, 0.0, loading=True)
            if self._e.remote is not None:
                known = self._e.remote.remembered(ns, listed[len(hits)])
                if known is None:  # ask the metaserver: the boundary awaits it
                    ask = functools.partial(
                        self._query_remote, instance_id, hashes, listed, hash_len
                    )
                    return QueryResult(0, 0, 0.0, pending=ask)
                if known[0]:
                    return QueryResult(known[0], 0, 0.0, loading=True)
        return self._answer(instance_id, hashes, hits, rest, hash_len)

    async def _query_remote(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        listed: list[BlockHash],
        hash_len: int | None,
    ) -> QueryResult:
        """The rest of a query that missed L1 and L3: the metaserver's plan."""
        ns = self._e.registry.instance(instance_id).namespace
        hits, rest = self._e.store.lookup(ns, hashes)  # again: the loop ran meanwhile
        if len(rest):
            n, started = await self._e.remote.loading(ns, listed, len(hits))
            if n:
                if started:
                    self._count_loading(ns, hashes, hits, rest, hash_len, n, "remote")
                return QueryResult(n, 0, 0.0, loading=True)
            if self._e.registry.instance(instance_id).namespace is not ns:
                # Re-registered (another geometry, perhaps) while we awaited:
                # nothing found under the old namespace may be leased to it.
                return QueryResult(0, 0, 0.0)
            hits, rest = self._e.store.lookup(ns, hashes)  # and again after the await
        return self._answer(instance_id, hashes, hits, rest, hash_len)

    def _count_loading(
        self,
        ns: Namespace,
        hashes: list[BlockHash] | PackedHashes,
        hits: list[BlockEntry],
        rest: np.ndarray,
        hash_len: int | None,
        n: int,
        tier: str,
    ) -> None:
        """Counted once, when the load starts: the engine's polls while it runs
        are waits, not new requests; its final ready answer counts as usual."""
        total = len(hits) + n
        if tier == "ssd":
            self._e.hit_rates.query(ns, hashes, total, rest[n:], hash_len, ssd=n)
            self._e.metrics.ssd_hits.inc(n)
        else:
            self._e.hit_rates.query(ns, hashes, total, rest[n:], hash_len, remote=n)

    def _answer(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        hits: list[BlockEntry],
        rest: np.ndarray,
        hash_len: int | None,
        direct: list[BlockHash] | None = None,
    ) -> QueryResult:
        """direct: the SSD blocks after the hits, leased for a direct read
        (pegaflow.tiers.ssd_gpu_direct)."""
        inst = self._e.registry.instance(instance_id)
        ns = inst.namespace
        n = len(direct) if direct else 0
        self._e.hit_rates.query(ns, hashes, len(hits) + n, rest[n:], hash_len, ssd=n)
        self._e.metrics.hits.inc(len(hits))
        if n:
            self._e.metrics.ssd_hits.inc(n)
        self._e.metrics.misses.inc(len(hashes) - len(hits) - n)
        if not hits and not n:
            return QueryResult(0, 0, 0.0)
        lease = self._e.leases.create(instance_id, ns.id, hits, inst.world_size, direct)
        return QueryResult(len(hits) + n, lease.id, self._e.leases.ttl_s)
