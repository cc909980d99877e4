"""The L2 remote tier wired into the engine: advertise what L1 holds, and on a
local miss (after L1 and L3) fetch the prefix from the peers that hold it.

A fetch, all on the event loop but the read itself:
1. a background task asks the metaserver for an ordered plan of (owner,
   block count) segments of the missing prefix, never naming us; the query
   waits --remote-query-timeout for it, then answers `loading` (a slow
   metaserver is no miss) and the engine's polls find the task's progress;
2. local L1 slots are reserved for the planned blocks (pinned, in flight: a
   concurrent save of one deduplicates) and the query answers `loading`;
3. per owner, concurrently (pegaflow.tiers.remote.fetch): Pin RPC (the owner
   pins the blocks, up to its pin budget, and answers their slot addresses;
   their checksums, bound to each block's key, come with it or, hashed while
   we read, from a Checksums RPC), checked against our geometry, then one
   batched one-sided read into our slots on a worker thread, whose slots are
   hashed and compared; Release; the rest of a run longer than the budget
   is pinned in another round;
4. blocks that arrived intact are published like local saves; the rest are
   freed and counted by cause. The engine's next poll finds them ready.

A read that failed while some of its bytes may still land (Mooncake cannot
cancel the other tasks of a failed batch) leaves its slots quarantined: kept
out of the allocator for --remote-quarantine seconds, so no later block is
written over by a stale task. While quarantined slots hold more than
_QUARANTINE_SHARE of the pool, fetches are not started (cause "quarantine").

Failures become misses, never hangs or wrong bytes: every step has a deadline
(--remote-fetch-timeout, the plan's included), and a prefix whose fetch
failed, or that the metaserver did not know, is remembered for a moment so
the engine's next poll answers at once instead of starting again. Slots
reserved for a read that outlives its deadline stay reserved until the read's
thread returns: they are never handed out while a read may still write them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence

import grpc
import numpy as np

from pegaflow.cache.block_store import BlockEntry, BlockStore
from pegaflow.cache.instances import Instance
from pegaflow.cache.pool import HostPool
from pegaflow.common import peer_auth
from pegaflow.common.channels import channel_options
from pegaflow.common.keys import BlockHash, Key, Namespace
from pegaflow.metaserver.meta_client import pack
from pegaflow.proto import metaserver_pb2 as meta_pb
from pegaflow.proto import metaserver_pb2_grpc as meta_grpc

from ..protocol import MISS, Lookup, Tier
from .advertiser import Advertiser
from .fetch import (
    OwnerReads,
    PlanSegment,
    clip_plan,
    elapsed_ms,
    plan_from,
)
from .peers import Endpoint, PeerChannels
from .pins import PinTable
from .remote_config import RemoteConfig
from .remote_metrics import RemoteMetrics, RemoteStats, link_report
from .slot_sums import SlotHasher
from .transfer_engine import RemoteTransport, quarantine_s

logger = logging.getLogger(__name__)

_REMEMBERED = 1 << 16  # prefixes remembered as failed or unknown, and unfetched keys
# Prefixes whose metaserver answer is awaited at once (each one request, however
# many queries poll it); a query for another one past it is a miss (counted).
MAX_PLANNING = 1024
# A peer that keeps failing mid-read must not shrink the pool by more than this.
_QUARANTINE_SHARE = 1 / 8


class RemoteLink(Tier):
    """The remote tier (pegaflow.tiers.protocol): hears which blocks become
    ready here and which leave, to advertise them; a query's miss asks the
    metaserver (an `asking` lookup) and fetches the planned prefix."""

    medium = "remote"

    def __init__(
        self,
        config: RemoteConfig,
        store: BlockStore,
        pool: HostPool,
        metrics: RemoteMetrics,
        transport: RemoteTransport,
        node_id: str,
        incarnation: int,
        rpc_addr: str,
    ) -> None:
        self.config = config
        self._store = store
        self._pool = pool
        self.metrics = metrics
        self.transport = transport
        self.node_id = node_id
        self.incarnation = incarnation
        self.endpoint = Endpoint(rpc_addr, transport.endpoint)
        self.namespaces: dict[bytes, Namespace] = {}  # digest -> namespace held
        self._digests: dict[int, bytes] = {}
        self._hasher = SlotHasher()
        self.pins = PinTable(store, pool, self._hasher)
        # As in pegaflow.tiers.ssd_link: key being fetched -> blocks of its fetch from
        # it on.
        self._loading: dict[Key, int] = {}
        self._negative: OrderedDict[Key, float] = OrderedDict()  # key -> until
        # Prefixes the metaserver is being asked about (first key -> the task
        # that asks and starts the fetch), and first keys of fetches started
        # in the background that no answer has counted as a hit yet.
        self._planning: dict[Key, asyncio.Future[None]] = {}
        self._untold: set[Key] = set()
        self._unfetched: OrderedDict[Key, None] = OrderedDict()  # for the miss causes
        self._tasks: set[asyncio.Task[None]] = set()
        self._quarantine_timers: set[asyncio.TimerHandle] = set()
        self.quarantined_bytes = 0
        self.stats = RemoteStats()
        addr = config.metaserver_host_port
        self._meta_channel = grpc.aio.insecure_channel(addr, options=channel_options())
        self._meta = meta_grpc.MetaServerStub(self._meta_channel)
        self._meta_metadata = peer_auth.metadata(config.token)
        self._peers = PeerChannels(config.token)
        self._reads = OwnerReads(
            self._peers, transport, pool, metrics, self.stats, node_id, self._fail,
            self._tasks, self._hasher,
        )  # fmt: skip
        self.advertiser: Advertiser | None = None

    def start_advertising(self, advertiser: Advertiser) -> None:
        self.advertiser = advertiser
        advertiser.start()

    # -- namespaces -------------------------------------------------------------
    def digest(self, ns: Namespace) -> bytes:
        got = self._digests.get(ns.id)
        if got is None:
            got = self._digests[ns.id] = ns.digest
            self.namespaces[got] = ns
        return got

    def forget(self, ns_id: int) -> None:
        digest = self._digests.pop(ns_id, None)
        if digest is not None:
            self.namespaces.pop(digest, None)

    # -- advertising (BlockStore events) ------------------------------------------
    def ready(self, entries: list[BlockEntry]) -> None:
        """Blocks that became ready here (saved, or loaded from a slower tier)."""
        if self.advertiser is None:
            return
        for ns_id, hashes in _by_namespace(e.key for e in entries).items():
            ns = self._store.namespace(ns_id)
            if ns is not None:
                self.advertiser.advertise(self.digest(ns), hashes)

    def removed(self, keys: list[Key]) -> None:
        """Ready blocks that left L1 (evicted, or their namespace freed)."""
        self.pins.forget(keys)
        if self.advertiser is None:
            return
        for ns_id, hashes in _by_namespace(keys).items():
            digest = self._digests.get(ns_id)
            if digest is not None:
                self.advertiser.withdraw(digest, hashes)

    async def snapshot(self) -> dict[bytes, list[bytes]]:
        """Every ready block held, by namespace digest: the advertiser re-sends
        it after a (re)join. Walks the index in slices, yielding the loop."""
        keys = list(self._store.entries.items())
        by_ns: dict[int, list[bytes]] = {}
        for start in range(0, len(keys), 50_000):
            for (ns_id, h), entry in keys[start : start + 50_000]:
                if entry.ready:
                    by_ns.setdefault(ns_id, []).append(h)
            await asyncio.sleep(0)
        namespaces = {i: self._store.namespace(i) for i in by_ns}
        return {
            self.digest(ns): by_ns[i] for i, ns in namespaces.items() if ns is not None
        }

    # -- the query path -----------------------------------------------------------
    def lookup(self, inst: Instance, hashes: list[BlockHash], start: int) -> Lookup:
        """`loading` while a plan or a fetch from hashes[start] runs, a miss
        while that prefix is remembered as not fetchable; else `asking` the
        metaserver."""
        known = self.known(inst.namespace, hashes[start])
        return Lookup("asking", ask=self.loading) if known is None else known

    def known(self, ns: Namespace, first: BlockHash) -> Lookup | None:
        """`loading` while the metaserver is asked about the prefix from
        `first` or a fetch of it runs (`started` for the first answer after a
        fetch began in the background), a miss while the prefix is remembered
        as not fetchable; None: ask."""
        key = (ns.id, first)
        running = self._loading.get(key)
        if running is not None:
            told = key in self._untold
            self._untold.discard(key)
            return Lookup("loading", running, told)
        if key in self._planning:
            return Lookup("loading")
        until = self._negative.get(key)
        if until is not None:
            if until > time.monotonic():
                return MISS
            del self._negative[key]
        return None

    async def loading(
        self, ns: Namespace, hashes: Sequence[BlockHash], start: int
    ) -> Lookup:
        """What the query answers for hashes[start:]: the metaserver is asked
        (once per prefix, however many queries poll it) and the plan fetched
        in a background task; the query waits --remote-query-timeout for it.
        An answer later than that is no miss: the query answers `loading`
        (nothing reserved yet) and the engine's next poll finds the fetch
        running (DESIGN.md: a slow tier answers `loading`, never a false
        miss). A metaserver that has not answered by the fetch deadline, or
        fails, makes the prefix a miss, remembered for a moment."""
        first = hashes[start]
        key = (ns.id, first)
        task = self._planning.get(key)
        if task is None:
            if len(self._planning) >= MAX_PLANNING:
                # A bounded queue: past it, a miss (counted), never a stall.
                self.metrics.failures.labels("metaserver").inc(len(hashes) - start)
                return MISS
            task = asyncio.ensure_future(self._plan_and_fetch(ns, list(hashes[start:])))
            task.add_done_callback(_log_failure)
            self._planning[key] = task
        await asyncio.wait({task}, timeout=self.config.query_timeout_s)
        known = self.known(ns, first)
        return MISS if known is None else known

    async def _plan_and_fetch(self, ns: Namespace, rest: list[BlockHash]) -> None:
        """Ask the metaserver for a plan of `rest` (up to the fetch deadline)
        and start its fetch; a failed or empty plan is remembered."""
        first = (ns.id, rest[0])
        began = time.monotonic()
        try:
            plan = await self._plan(ns, rest, self.config.fetch_timeout_s)
            self.stats.last_phases_ms = {"plan": elapsed_ms(began)}
        except (grpc.RpcError, asyncio.TimeoutError, ValueError) as exc:
            logger.debug("metaserver query failed: %s", exc)
            self.metrics.failures.labels("metaserver").inc(len(rest))
            self._remember(first)
            return
        finally:
            self._planning.pop(first, None)
        if not plan:
            self._remember(first)
            return
        if first in self._loading or first in self._store.entries:
            return  # fetched by another query, or saved here, while we asked
        planned = plan[-1].start + plan[-1].blocks
        if self.quarantined_bytes > self._pool.size * _QUARANTINE_SHARE:
            self._mark_unfetched(ns, rest[:planned], "quarantine")
            self._remember(first)
            return
        entries = self._store.reserve_load(ns, rest[:planned])
        if not entries:
            self._mark_unfetched(ns, rest[:planned], "no_slot")
            self._remember(first)
            return
        n = len(entries)
        plan = clip_plan(plan, n)
        self._loading.update(
            zip((e.key for e in entries), range(n, 0, -1), strict=True)
        )
        self._untold.add(first)  # the next answer about it counts the hit
        task = asyncio.ensure_future(self._fetch(ns, entries, plan, began))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _plan(
        self, ns: Namespace, hashes: list[BlockHash], timeout_s: float
    ) -> list[PlanSegment]:
        if len(set(map(len, hashes))) != 1:
            return []  # the metaserver takes one hash length per request
        reply = await self._meta.QueryPrefix(
            meta_pb.QueryPrefixRequest(
                blocks=pack(self.digest(ns), hashes), asker_node_id=self.node_id
            ),
            timeout=timeout_s,
            metadata=self._meta_metadata,
        )
        return plan_from(reply.segments, self.node_id, len(hashes))

    # -- the fetch ----------------------------------------------------------------
    async def _fetch(
        self,
        ns: Namespace,
        entries: list[BlockEntry],
        plan: list[PlanSegment],
        began: float,
    ) -> None:
        ok = np.zeros(len(entries), bool)
        tainted = np.zeros(len(entries), bool)
        deadline = began + self.config.fetch_timeout_s
        reads = [
            asyncio.ensure_future(
                self._reads.run(
                    ns, self.digest(ns), entries, seg, ok, tainted, deadline
                )
            )  # fmt: skip
            for seg in plan
        ]
        done, late = await asyncio.wait(
            reads, timeout=max(0.0, deadline - time.monotonic())
        )
        for task in done:
            if task.exception() is not None:
                logger.warning("remote fetch failed: %r", task.exception())
        if late:
            # A read may still write our slots: they stay reserved until every
            # segment's thread returned, and only then are they freed.
            lost = sum(s.blocks for s, t in zip(plan, reads, strict=True) if t in late)
            self.metrics.failures.labels("deadline").inc(lost)
            # What a query waiting for them saw: the tier's rate drops.
            planned = len(entries) * ns.block_bytes
            self.rate.observe(planned, time.monotonic() - began)
            self._unloading(entries)
            self._remember(entries[0].key)
            await asyncio.wait(late)
            lost = np.zeros(len(entries), bool)
            held = self._store.finish_load(entries, lost, tainted)
            self._quarantine(held, ns.slot_bytes)
            return
        self._unloading(entries)
        good = int(ok.sum())
        if good < len(entries):
            self._remember(entries[0].key)
        nbytes = good * ns.block_bytes
        seconds = time.monotonic() - began
        self.metrics.hits.inc(good)
        self.metrics.bytes.inc(nbytes)
        self.metrics.fetch_seconds.observe(seconds)
        self.rate.observe(nbytes, seconds)
        st = self.stats
        st.fetches += 1
        st.fetched_blocks += good
        st.fetched_bytes += nbytes
        st.fetch_seconds += seconds
        st.last_fetch_s = seconds
        publishing = time.monotonic()
        held = self._store.finish_load(entries, ok, tainted)
        self._quarantine(held, ns.slot_bytes)
        st.last_phases_ms["publish"] = elapsed_ms(publishing)  # after fetch_ms
        logger.debug(
            "fetched %d of %d blocks (%d B) from %d peer(s) in %.1f ms",
            good, len(entries), nbytes, len(plan), seconds * 1e3,
        )  # fmt: skip

    def _fail(self, keys: list[Key], cause: str) -> None:
        self.metrics.failures.labels(cause).inc(len(keys))
        for key in keys:
            self._unfetched[key] = None
        while len(self._unfetched) > _REMEMBERED:
            self._unfetched.popitem(last=False)

    def _mark_unfetched(
        self, ns: Namespace, hashes: list[BlockHash], cause: str
    ) -> None:
        self._fail([(ns.id, h) for h in hashes], cause)

    def _quarantine(self, slots: np.ndarray, slot_bytes: int) -> None:
        """Slots a failed read may still write: back to the allocator only
        after the quarantine."""
        if not len(slots):
            return
        nbytes = len(slots) * slot_bytes
        seconds = self.config.quarantine_s or quarantine_s()
        self.quarantined_bytes += nbytes
        self.metrics.quarantined.inc(len(slots))
        self.stats.quarantined_slots += len(slots)
        logger.warning(
            "%d slot(s) quarantined for %.0f s: a failed read may still write them",
            len(slots), seconds,
        )  # fmt: skip

        def release() -> None:
            self._quarantine_timers.discard(timer)
            self.quarantined_bytes -= nbytes
            self._store.free_withheld(slots)

        timer = asyncio.get_running_loop().call_later(seconds, release)
        self._quarantine_timers.add(timer)

    def _unloading(self, entries: list[BlockEntry]) -> None:
        for e in entries:
            self._loading.pop(e.key, None)
        self._untold.discard(entries[0].key)

    def _remember(self, key: Key) -> None:
        self._negative[key] = time.monotonic() + self.config.negative_ttl_s
        self._negative.move_to_end(key)
        while len(self._negative) > _REMEMBERED:
            self._negative.popitem(last=False)

    # -- the miss breakdown -------------------------------------------------------
    def probe(self, ns_id: int, hashes: list[bytes]) -> np.ndarray:
        """Which missed blocks the metaserver named but we did not fetch."""
        known = self._unfetched
        return np.fromiter(((ns_id, h) in known for h in hashes), bool, len(hashes))

    # -- what /stats and `pegaflow-server status` show ---------------------------
    def report(self) -> dict[str, object]:
        head = {
            "node_id": self.node_id,
            "incarnation": self.incarnation,
            "loading_blocks": len(self._loading),
            "planning": len(self._planning),
            "endpoint": str(self.endpoint),
            "metaserver": self.config.metaserver_host_port,
        }
        return link_report(head, self.stats, self.metrics, self.advertiser) | {
            "pins_held": len(self.pins),
            "pins_expired": self.pins.expired,
            "pins_refused": self.pins.refused,
            "quarantined_bytes": self.quarantined_bytes,
        }

    # -- housekeeping ------------------------------------------------------------
    def sweep(self) -> None:
        self.pins.sweep()
        self.metrics.pins.set(len(self.pins))

    async def close(self) -> None:
        for task in list(self._planning.values()):  # nothing reserved yet
            task.cancel()
        if self.advertiser is not None:
            await asyncio.to_thread(self.advertiser.close)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.config.fetch_timeout_s)
        for timer in self._quarantine_timers:  # the slots go with the process
            timer.cancel()
        self.pins.close()
        await asyncio.to_thread(self._hasher.close)  # after the pins' hashing
        await self._peers.close()
        await self._meta_channel.close()
        await asyncio.to_thread(self.transport.close)


def _log_failure(task: asyncio.Future[None]) -> None:
    """A background task's unexpected error, logged (nobody awaits it)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("remote plan failed", exc_info=task.exception())


def _by_namespace(keys) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    for ns_id, h in keys:
        out.setdefault(ns_id, []).append(h)
    return out
