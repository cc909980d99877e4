"""The server's core: registration, save, prefix query, load and leases.

Metadata changes run on one thread (the asyncio loop); only byte copies leave it,
for a worker thread or a GPU stream the loop launched them on
(pegaflow.server.copy_dispatch), with every block they touch pinned. Between
the awaits the bookkeeping is therefore atomic without locks.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from pegaflow.cache.block_entry import SaveReservation
from pegaflow.cache.block_store import BlockStore
from pegaflow.cache.eviction import EvictionPolicy
from pegaflow.cache.instances import Instance, Registry, Worker
from pegaflow.cache.leases import LeaseTable
from pegaflow.cache.miss_reasons import HitRateTracker, RecordingPolicy
from pegaflow.cache.pool import HostPool
from pegaflow.cache.prefix_eviction import make_policy
from pegaflow.cache.registration_checks import RegisterSpec
from pegaflow.common import deadlines
from pegaflow.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    LeaseNotFound,
    PegaflowError,
)
from pegaflow.common.geometry import Transfers, check_block_ids
from pegaflow.common.identity import CallContext, Caller
from pegaflow.common.keys import BlockHash, LoadSpec, PackedHashes
from pegaflow.common.rate_meter import RateMeter
from pegaflow.common.request_limits import LargeRequestGate, RequestCaps
from pegaflow.common.results import (
    LoadBatchResult,
    QueryResult,
    SaveResult,
)
from pegaflow.common.settings import EngineConfig
from pegaflow.copiers.copier import CopyEngine, RegionKind
from pegaflow.copiers.layer_signals import LayerSignals, scatter_by_layer
from pegaflow.tiers.protocol import Tier

from .block_events import BlockEventHub
from .copy_dispatch import CopyDispatch, uncancellable
from .in_flight import InFlightLoads, start_copy
from .load_items import LoadItem, item_results, l1_transfers, plan_item
from .metrics import Metrics
from .namespaces import NamespaceReaper
from .query_path import PrefixQueries, check_hashes
from .save_waits import Landings

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        pool: HostPool,
        copiers: dict[RegionKind, CopyEngine],
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        # TinyLFU's capacity: block sizes are unknown until engines register;
        # ~1 MiB is typical.
        lfu = max(1024, pool.size >> 20) if config.enable_lfu_admission else 0
        policy: EvictionPolicy = make_policy(config.eviction, lfu)
        # Hit rates, their ceiling and the miss breakdown; the wrapper feeds it
        # the evictions and refusals that later misses are blamed on.
        self.hit_rates = HitRateTracker(
            config.hit_rate, HitRateTracker.ghost_bits_for(pool.size)
        )
        policy = RecordingPolicy(policy, self.hit_rates)
        self.store = BlockStore(pool.slabs, policy)
        self.store.add_listener(self.hit_rates)  # saves refused: a miss cause
        leased = int(pool.size * config.max_leased_share)  # all users' at most
        self.leases = LeaseTable(self.store, config.lease_ttl_s, leased)
        self.registry = Registry(
            copiers,
            max_slot_bytes=pool.slab_bytes,
            allow_tcp_host_engines=config.allow_tcp_host_engines,
            open_signals=LayerSignals,
        )
        self.caps = RequestCaps(
            pool.size, pool.slab_bytes, config.max_blocks_per_request
        )
        self.gate = LargeRequestGate(
            config.max_large_requests, config.large_request_descriptors
        )
        self.metrics = metrics if metrics is not None else Metrics()
        # While the GPU half of the start runs (pegaflow.server.cuda_bringup),
        # what a CUDA engine's registration awaits first.
        self.cuda_ready: Callable[[], Awaitable[None]] | None = None
        # The lower tiers in query order (add_tier, at start-up).
        self.tiers: list[Tier] = []
        self.namespaces = NamespaceReaper(
            self.registry,
            self.store,
            self.leases,
            self.hit_rates,
            self.tiers,
            config.max_idle_namespaces,
        )
        self._loads_in_flight = InFlightLoads(self.metrics.loads_in_flight)
        # Recent L1 -> engine copy rates, per copy engine (host, CUDA): what
        # query answers tell connectors (their fetch-or-recompute planner).
        self.load_rates: dict[CopyEngine, RateMeter] = collections.defaultdict(
            RateMeter
        )
        self.queries = PrefixQueries(
            self.registry,
            self.store,
            self.tiers,
            self.leases,
            self.hit_rates,
            self.metrics,
            config.max_blocks_per_request,
            self._load_gbps,
        )
        # What L1 holds, streamed to engines for KV-aware routers (WatchBlocks).
        self.block_events = BlockEventHub(
            self.registry,
            self.store,
            self.queries,
            config.max_block_watchers,
            config.block_events_buffer,
            self.metrics.block_event_resyncs.inc,
        )
        self.metrics.block_watchers.set_function(lambda: self.block_events.watchers)
        self.store.add_listener(self.block_events)
        self._seen = dataclasses.replace(self.store.counters)
        self._children: dict[str, tuple] = {}  # _account's labelled metrics
        # Saves waiting for blocks another writer had in flight.
        self.landings = Landings(self.store)
        self.copies = CopyDispatch(
            self.registry,
            self.gate,
            config.inline_copy_bytes,
            self.metrics,
            lambda w: self.unregister(w.instance_id, w.tp_rank),
        )
        self.metrics.bind_gauges(
            pool.size,
            lambda: pool.slabs.used_bytes,
            lambda: self.store.resident_ready,
            lambda: len(self.leases),
            lambda: sum(len(i.workers) for i in self.registry.instances.values()),
        )

    def add_tier(self, tier: Tier) -> None:
        """A lower tier, asked after those added before it; it hears L1's
        block events from now on."""
        self.tiers.append(tier)
        self.store.add_listener(tier)

    # -- registration ---------------------------------------------------------
    async def register_when_ready(
        self,
        spec: RegisterSpec,
        caller: Caller,
        vouch: Callable[[], None] | None = None,
    ) -> Worker:
        """register(), once the GPU half of the start is up for a CUDA engine.
        vouch: raises when the caller is no longer the process its pid named
        (the unix socket's connecting process exited); asked after the wait,
        and again once the registration holds the pid's process: alive then,
        the process it opened is the caller."""
        if spec.region_kind == "cuda" and self.cuda_ready is not None:
            await self.cuda_ready()
        if vouch is not None:
            vouch()
        worker = self.register(spec, caller)
        if vouch is not None:
            try:
                vouch()
            except BaseException:
                self.unregister(spec.instance_id, spec.tp_rank)
                raise
        return worker

    def register(self, spec: RegisterSpec, caller: Caller) -> Worker:
        worker = self.registry.register(spec, caller)
        self.namespaces.joined(worker.namespace)
        return worker

    def unregister(
        self, instance_id: str, tp_rank: int, ctx: CallContext | None = None
    ) -> None:
        """ctx None: the server itself drops the worker (its session ended)."""
        if ctx is not None:
            self.registry.owned_worker(
                instance_id, tp_rank, ctx.caller, ctx.owner_token
            )
        worker = self.registry.unregister(instance_id, tp_rank)
        if instance_id not in self.registry.instances:
            dropped = self.leases.release_owned_by(instance_id)
            if dropped:
                logger.info("released %d lease(s) of %s", dropped, instance_id)
        self.namespaces.left(worker.namespace)  # after its leases went

    # -- save -----------------------------------------------------------------
    async def save(
        self,
        instance_id: str,
        tp_rank: int,
        block_ids: np.ndarray,
        hashes: list[BlockHash],
        layer_ids: np.ndarray | None,
        wait_event: int,
        ctx: CallContext,
    ) -> SaveResult:
        """wait_event: 1-based index of the worker's CUDA IPC event that the copy
        waits for on the GPU (the engine's KV writes); 0 for none. No copy
        starts after ctx.deadline, and a copy that ends after it publishes
        nothing: the engine may have rewritten those pages since."""
        worker = self.registry.owned_worker(
            instance_id, tp_rank, ctx.caller, ctx.owner_token
        )
        deadlines.check(ctx.deadline, "save")
        self.caps.check(worker.namespace.slot_class, len(block_ids), "block_ids")
        ns = worker.namespace
        if len(block_ids) != len(hashes):
            raise InvalidRequest(
                f"block_hashes: {len(hashes)} hashes for {len(block_ids)} block_ids"
            )
        check_hashes(hashes, self.config.max_blocks_per_request)
        check_block_ids(block_ids, worker.geometry.num_blocks, "block_ids")
        layers = self._layers(layer_ids, ns.num_layers)
        # Replicated KV (MLA): every rank saves into the block's one shard.
        res = self.store.reserve_save(ns, worker.shard, hashes, layers)
        self._sync_counters()
        stored = await self._copy_save(worker, block_ids, res, layers, wait_event, ctx)
        if not len(res.waits):
            return SaveResult(stored, res.deduplicated, res.rejected)
        more, undone, rejected = await self._save_unlanded(
            worker, block_ids, hashes, layers, wait_event, ctx, res
        )
        return SaveResult(
            stored + more, res.deduplicated - undone, res.rejected + rejected
        )

    async def _copy_save(
        self,
        worker: Worker,
        block_ids: np.ndarray,
        res: SaveReservation,
        layers: np.ndarray,
        wait_event: int,
        ctx: CallContext,
    ) -> int:
        """Copy a reservation's blocks from the engine and publish them: how
        many (0 for none reserved)."""
        if not res.keys:
            return 0
        transfers = worker.geometry.engine_to_slots(
            block_ids[res.positions], res.slots, layers
        )
        gather = functools.partial(worker.copier.gather, deadline=ctx.deadline)
        ok = False
        try:
            # An event-gated copy waits for the engine's compute: never on the
            # loop, unless the event already completed (then it needs no wait;
            # a hop to a thread costs more than a small copy). Host copiers
            # refuse any event, here.
            if wait_event and not worker.copier.event_done(worker.handle, wait_event):
                gather = functools.partial(gather, wait_event=wait_event)
                inline = False
            else:
                inline = True
            seconds = await self.copies.run(
                worker, gather, transfers, inline, ctx.deadline,
                launch_as="save" if inline else None, direction="save",
            )  # fmt: skip
            if ctx.deadline is not None and time.monotonic() > ctx.deadline:
                raise DeadlineExceeded(
                    "save: the copy ended after the request's deadline; nothing "
                    "was published (the engine may have reused those pages)"
                )
            ok = True
        finally:
            self.store.finish_save(res, ok)
        self._account("save", len(res.keys), transfers.total_bytes, seconds)
        return len(res.keys)

    async def _save_unlanded(
        self,
        worker: Worker,
        block_ids: np.ndarray,
        hashes: list[BlockHash],
        layers: np.ndarray,
        wait_event: int,
        ctx: CallContext,
        res: SaveReservation,
    ) -> tuple[int, int, int]:
        """The blocks `res` deduplicated against ones still landing
        (pegaflow.server.save_waits): once those settled, the ones that did
        not land are saved again. (stored now, of `res`'s deduplicated the
        ones that did not land, rejected: not stored, at the deadline or
        with the worker gone or a copy failed)."""
        stored = undone = rejected = 0
        positions, waited = res.waits, res.waited
        while len(positions):
            lost = await self.landings.wait(waited, res.mask, ctx.deadline)
            again = positions[lost]
            undone += len(again)
            if not len(again):
                break
            past = ctx.deadline is not None and time.monotonic() >= ctx.deadline
            if worker.closed or past:  # no copy starts after the deadline
                return stored, undone, rejected + len(again)
            sub = [hashes[i] for i in again.tolist()]
            r = self.store.reserve_save(worker.namespace, worker.shard, sub, layers)
            self._sync_counters()
            try:
                got = await self._copy_save(
                    worker, block_ids[again], r, layers, wait_event, ctx
                )
            except PegaflowError as exc:  # its own blocks are stored: say so
                logger.info("save: %d blocks not saved again: %s", len(r.keys), exc)
                resident = r.deduplicated - len(r.waits)  # landed after all
                return stored, undone - resident, rejected + len(again) - resident
            stored += got
            undone -= r.deduplicated - len(r.waits)  # resident by now after all
            rejected += r.rejected
            positions, waited = again[r.waits], r.waited
            undone -= len(positions)  # counted again if they do not land
        return stored, undone, rejected

    @staticmethod
    def _layers(layer_ids: np.ndarray | None, num_layers: int) -> np.ndarray:
        if layer_ids is None or len(layer_ids) == 0:
            return np.arange(num_layers)
        if layer_ids.min() < 0 or layer_ids.max() >= num_layers:
            raise InvalidRequest(f"layer_ids: must lie in [0, {num_layers})")
        if len(np.unique(layer_ids)) != len(layer_ids):
            raise InvalidRequest("layer_ids: duplicates")
        return np.sort(layer_ids)

    # -- query ----------------------------------------------------------------
    def query(
        self,
        instance_id: str,
        hashes: list[BlockHash] | PackedHashes,
        hash_len: int | None = None,
        ctx: CallContext | None = None,
    ) -> QueryResult:
        """The longest cached prefix, or `loading` (pegaflow.server.query_path)."""
        return self.queries.query(instance_id, hashes, hash_len, ctx)

    # -- load -----------------------------------------------------------------
    async def load(
        self,
        instance_id: str,
        tp_rank: int,
        items: list[LoadSpec],
        batch: bool,
        layer_seq: int,
        ctx: CallContext,
        done_event: int = 0,
        hang_up: Callable[[], None] | None = None,
    ) -> LoadBatchResult:
        """Leased blocks into engine blocks, every item in one copy.

        A malformed item fails the call before anything moves (InvalidRequest
        naming `items[i].field`). An item whose lease is gone is an expected
        "no" (it expired, or was released, between the query and this load):
        it is reported in its result and the other items load. batch=False is
        the original one-lease request: fields unprefixed, a gone lease raises.
        layer_seq != 0: copy layer by layer, writing it to the worker's layer
        signal words as each layer lands (the engine starts that layer early).
        No copy starts after ctx.deadline: the engine may reuse the blocks
        once it has given up on this load. done_event (a GPU worker's event,
        1-based): a copy launched from here is answered as soon as it is
        queued (`in_flight`), the event recorded after it; else when done.
        hang_up: ends the caller's connection, should such a copy fail.
        """
        worker = self.registry.owned_worker(
            instance_id, tp_rank, ctx.caller, ctx.owner_token
        )
        deadlines.check(ctx.deadline, "load")
        self.caps.check_load(worker.namespace.slot_class, items, batch)
        if layer_seq and worker.signals is None:
            raise InvalidRequest(
                f"layer_seq: rank {tp_rank} of {instance_id!r} registered no "
                "layer_signals"
            )
        if len(items) > self.config.max_blocks_per_request:
            raise InvalidRequest(
                f"items: {len(items)} exceeds {self.config.max_blocks_per_request}"
            )
        plans: list[LoadItem | None] = []
        errors: list[str] = []
        for i, (lease_id, offset, block_ids) in enumerate(items):  # per request
            field = f"items[{i}]." if batch else ""
            try:
                lease = self.leases.get(lease_id)
            except LeaseNotFound as exc:
                if not batch:
                    raise
                plans.append(None)
                errors.append(f"{field}{exc}")
                continue
            plans.append(plan_item(worker, lease, offset, block_ids, field))
            errors.append("")
        live = [p for p in plans if p is not None]
        entries = [e for p in live for e in p.entries]
        transfers = l1_transfers(worker, live, entries)
        scatter = functools.partial(worker.copier.scatter, deadline=ctx.deadline)
        if layer_seq:
            scatter = functools.partial(
                scatter_by_layer,
                worker.copier,
                worker.geometry,
                worker.signals,
                layer_seq,
                ctx.deadline,
            )
        if done_event:  # a bad index is refused before anything moves
            check = getattr(worker.copier, "check_event", None)
            done_event = done_event if check is not None and not layer_seq else 0
            if done_event:
                check(worker.handle, done_event, "done_event")
            # A copy this small runs inline (or by a thread): never in flight,
            # and the task below would cost it ~0.1 ms (H100, session 17).
            if transfers.total_bytes <= self.config.inline_copy_bytes:
                done_event = 0
        # A lease may expire while we read from the SSD or copy.
        self.store.pin(entries)
        try:
            landed = await self._load_direct(worker, live, ctx.deadline)
        except BaseException:
            self.store.unpin(entries)
            raise
        launched = asyncio.get_running_loop().create_future() if done_event else None
        leases = {id(p.lease): p.lease for p in live}
        copy = self._l1_load(worker, entries, scatter, transfers, layer_seq, ctx,
                             leases, done_event, launched)  # fmt: skip
        results = functools.partial(
            item_results, plans, errors, landed, batch, worker.geometry.slot_bytes
        )
        if launched is None:  # answered once done: no task, no loop iteration
            await copy
            return results()
        task = start_copy(copy)
        try:
            if not launched.done():
                await asyncio.wait(
                    {task, launched}, return_when=asyncio.FIRST_COMPLETED
                )
        except asyncio.CancelledError:  # its engine left: the copy ends anyway
            self._loads_in_flight.keep(task, None, answered=False)
            raise
        if launched.done() and launched.result() and not task.done():
            self._loads_in_flight.keep(task, hang_up)  # it waits on done_event
            return results(in_flight=True)
        await task
        return results()

    async def _l1_load(self, worker: Worker, entries: list, scatter: Callable,
                       transfers: Transfers, layer_seq: int, ctx: CallContext,
                       leases: dict, done_event: int,
                       launched: asyncio.Future | None) -> None:  # fmt: skip
        """The load's one L1 copy and what follows it; with `launched`, the
        engine's done_event is recorded after the copy as it is queued, and
        `launched` says whether it was (the load may then be answered)."""

        def on_launch() -> None:
            assert launched is not None
            try:
                worker.copier.record_done(worker.handle, done_event)
            except BaseException:  # not recorded: answered once done
                launched.set_result(False)
                raise
            launched.set_result(True)

        seconds = 0.0
        try:
            # Layer by layer the engine waits on each signal, not on this loop.
            if entries or layer_seq:  # (the signals go out even with no copy)
                seconds = await self.copies.run(
                    worker, scatter, transfers, not layer_seq, ctx.deadline,
                    launch_as=None if layer_seq else "load", direction="load",
                    layer_wise=bool(layer_seq),
                    on_launch=on_launch if launched is not None else None,
                )  # fmt: skip
        finally:
            self.store.unpin(entries)
            if launched is not None and not launched.done():
                launched.set_result(False)
        for lease in leases.values():
            if lease.id in self.leases:
                self.leases.consumed(lease, worker.tp_rank)
        self._account("load", len(entries), transfers.total_bytes, seconds)
        if entries and not layer_seq:  # layer by layer, the engine sets the pace
            self.load_rates[worker.copier].observe(transfers.total_bytes, seconds)

    async def _load_direct(
        self, worker: Worker, live: list[LoadItem], deadline: float | None
    ) -> dict[int, int]:
        """The items' tier blocks read straight into the engine's blocks (before
        any L1 copy: a layer's signal must cover all its blocks), one read per
        tier that leased some; how many landed, by id() of each item."""
        wanted = [p for p in live if p.direct]
        if not wanted:
            return {}
        landed: dict[int, int] = {}
        readers = {id(p.lease.read): p.lease.read for p in wanted}
        worker.active_ops += 1  # its memory stays mapped until the reads end
        try:
            for key, read in readers.items():
                mine = [p for p in wanted if id(p.lease.read) == key]
                hashes = [h for p in mine for h in p.direct]
                ids = np.concatenate([p.direct_ids for p in mine])
                ok = await uncancellable(read(worker, hashes, ids, deadline))
                parts = np.split(ok, np.cumsum([len(p.direct) for p in mine])[:-1])
                landed.update(
                    (id(p), int(n.sum())) for p, n in zip(mine, parts, strict=True)
                )
        finally:
            self.registry.finish_op(worker)
        return landed

    def _load_gbps(self, instance: Instance) -> float:
        """The recent rate of loads by this instance's kind of copy (0.0:
        unknown)."""
        worker = next(iter(instance.workers.values()), None)
        meter = None if worker is None else self.load_rates.get(worker.copier)
        return 0.0 if meter is None else meter.gbps

    def release_lease(self, lease_id: int) -> None:
        self.leases.release(lease_id)

    # -- housekeeping -----------------------------------------------------------
    def sweep(self) -> None:
        now = time.monotonic()
        self.leases.sweep(now)
        for tier in self.tiers:
            tier.sweep()
            self.metrics.tier_rates.labels(tier.medium).set(tier.rate.gbps)
        for copier, meter in self.load_rates.items():
            label = f"l1_{type(copier).__name__.removesuffix('CopyEngine').lower()}"
            self.metrics.tier_rates.labels(label).set(meter.gbps)
        self.store.drop_stale(now - self.config.lease_ttl_s)
        self.hit_rates.flush()
        self.block_events.poll_tiers()

    def _account(self, direction: str, blocks: int, nbytes: int, sec: float) -> None:
        children = self._children.get(direction)
        if children is None:  # labels() costs a few us a call: once per direction
            m = self.metrics
            children = self._children[direction] = (
                m.bytes.labels(direction),
                m.blocks.labels(direction),
                m.transfer_seconds.labels(direction),
            )
        children[0].inc(nbytes)
        children[1].inc(blocks)
        children[2].observe(sec)
        logger.debug(
            "%s %d blocks, %d B in %.3f ms", direction, blocks, nbytes, sec * 1e3
        )

    def _sync_counters(self) -> None:
        """The store's counters into the metrics. In a full pool every save
        evicts: only the counters that moved are touched (labels() and
        dataclasses.replace cost ~7 us a save, dev VM)."""
        c, seen = self.store.counters, self._seen
        if c == seen:  # a pool with room: nothing evicted or refused
            return
        if c.evictions != seen.evictions:
            self.metrics.evictions.inc(c.evictions - seen.evictions)
            seen.evictions = c.evictions
        for kind, now, before in (
            ("tinylfu", c.admission_rejections, seen.admission_rejections),
            ("pool_full", c.pool_full_rejections, seen.pool_full_rejections),
        ):
            if now != before:
                self.metrics.admission_rejections.labels(kind).inc(now - before)
        seen.admission_rejections = c.admission_rejections
        seen.pool_full_rejections = c.pool_full_rejections
        seen.stale_dropped = c.stale_dropped

    async def drain_loads(self, timeout_s: float) -> None:
        """Until the copies of loads answered in flight ended."""
        await self._loads_in_flight.drain(timeout_s)

    def close(self) -> None:
        """After the tiers closed: their reads may use workers' mappings."""
        self.registry.close()
