"""What the server reports about itself: /health (health_report), the /stats
JSON document (engine_stats, read by `pegaflow-server status`) and the
hit-rate families of /metrics built from it.

The document is built on the engine's event loop (the HTTP thread hops there and
waits), so the bookkeeping it reads is never caught half-updated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pegaflow.cache.hll import SUB_WINDOWS
from pegaflow.cache.miss_reasons import CAUSES, HIT_TIERS

if TYPE_CHECKING:
    from pegaflow.gds import SsdTier
    from pegaflow.gds.gpu_route import RouteChoice

    from .engine import Engine
    from .warm_restart import RecoveryReport

logger = logging.getLogger(__name__)

T = TypeVar("T")
Stats = dict[str, object]


def engine_stats(
    engine: Engine,
    started: float,
    copy_path: Callable[[], dict[str, object]] | None = None,
    topology: Callable[[], dict[str, object]] | None = None,
) -> Stats:
    """Pool, tiers, policy, the GPU copy path (`copy_path`: the CUDA copy
    policy's report; None without a GPU), the NUMA placement of GPUs and pool
    pages (`topology`: pegaflow.common.topology.Placement.report), and per
    namespace: hits by tier, misses by cause, hit rate beside its HyperLogLog
    ceiling per window."""
    namespaces = [ns.to_dict() for ns in engine.hit_rates.snapshot()]
    slabs = engine.pool.slabs
    counters = engine.store.counters

    def tier_hits(tier: str) -> int:
        return sum(ns["hits"][tier] for ns in namespaces)

    hr = engine.hit_rates.config
    return {
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - started, 1),
        "pool": {
            "capacity_bytes": engine.pool.size,
            "used_bytes": slabs.used_bytes,
            "resident_blocks": engine.store.resident_ready,
            "leases": len(engine.leases),
            "instances": len(engine.registry.instances),
            "namespaces": len(engine.registry.namespaces),
        },
        "tiers": _tiers(engine, tier_hits),
        "policy": {
            "admission": "tinylfu" if engine.config.enable_lfu_admission else "all",
            "evictions": counters.evictions,
            "rejected": {
                "tinylfu": counters.admission_rejections,
                "pool_full": counters.pool_full_rejections,
            },
        },
        "copy_path": copy_path() if copy_path is not None else None,
        "topology": topology() if topology is not None else None,
        "hll": {
            "windows": list(hr.labels),
            "bucket_bits": hr.bucket_bits,
            "sub_windows": SUB_WINDOWS,
            "memory_bytes": engine.hit_rates.nbytes,
        },
        "namespaces": namespaces,
        # what registration tells: pegaflow_namespace_info (compat_metrics)
        "registered": [
            {
                "tag": ns.tag,
                # as on SSD and at the metaserver (a hash of name and geometry)
                "digest": ns.digest.hex(),
                "shards": ns.tp_size,
                "layers": ns.num_layers,
                "block_bytes": ns.slot_bytes,
            }
            for ns in engine.registry.namespaces.values()
        ],
    }


def on_loop(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout_s: float = 5.0
) -> Callable[[], T]:
    """fn, callable from another thread: it runs on `loop`, the caller waits."""

    def call() -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the waiting thread
                future.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return future.result(timeout_s)

    return call


class OncePerScrape:
    """engine_stats once per /metrics scrape, though two collectors read it:
    the first of a scrape computes it (on the event loop: a walk of every
    namespace), the second, on the same HTTP thread right after, takes that
    very value. Nothing is kept across scrapes, so no answer is stale."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats
        self._local = threading.local()

    def first(self) -> Stats:
        value = self._local.value = self._stats()
        return value

    def again(self) -> Stats:
        value, self._local.value = getattr(self._local, "value", None), None
        return value if value is not None else self._stats()


class HitRateCollector:
    """Prometheus families from engine_stats(): registered once per server."""

    def __init__(self, stats: Callable[[], Stats]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # unknown until the first read; keeps registration lazy

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._stats()
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("hit-rate metrics skipped: the event loop did not answer")
            return
        yield from families(stats)


def families(stats: Stats) -> Iterator[Metric]:
    """A namespace's series are labelled with its tag, never its name, and
    exist while the namespace has hit-rate state: a freed one's stop."""
    ns_label, win_label = ["namespace"], ["namespace", "window"]
    blocks = CounterMetricFamily(
        "pegaflow_query_blocks",
        "queried blocks by where they were found (ram, ssd, remote) or miss",
        labels=["namespace", "tier"],
    )
    causes = CounterMetricFamily(
        "pegaflow_query_miss_blocks_by_cause",
        "missed blocks by cause: compulsory, capacity, admission, pool_full, remote",
        labels=["namespace", "cause"],
    )
    resident = CounterMetricFamily(
        "pegaflow_query_miss_resident_blocks",
        "missed blocks that were resident behind an earlier miss of their prefix",
        labels=ns_label,
    )
    gauges = {
        key: GaugeMetricFamily(name, text, labels=win_label)
        for key, name, text in (
            ("hit_rate", "pegaflow_hit_rate", "measured block hit rate"),
            ("ceiling", "pegaflow_hit_rate_ceiling", "infinite cache hit rate, by HLL"),
            ("requests", "pegaflow_window_query_blocks", "N: blocks queried"),
            ("unique", "pegaflow_window_unique_blocks", "U: first seen, by HLL"),
        )
    }
    for ns in stats["namespaces"]:
        name = ns["tag"]
        for tier in HIT_TIERS:
            blocks.add_metric([name, tier], ns["hits"][tier])
        blocks.add_metric([name, "miss"], sum(ns["misses"].values()))
        for cause in CAUSES:
            causes.add_metric([name, cause], ns["misses"][cause])
        resident.add_metric([name], ns["resident_misses"])
        for window, values in ns["windows"].items():
            for key, family in gauges.items():
                family.add_metric([name, window], values[key])
    hll = GaugeMetricFamily(
        "pegaflow_hll_memory_bytes", "HyperLogLog windows and ghost table"
    )
    hll.add_metric([], stats["hll"]["memory_bytes"])
    yield from (blocks, causes, resident, *gauges.values(), hll)


def _tiers(engine: Engine, tier_hits: Callable[[str], int]) -> Stats:
    """/stats' tiers: L1, then each medium below it, enabled where a tier
    of that medium runs, with what the tier reports of itself."""
    out: Stats = {"ram": {"enabled": True, "hit_blocks": tier_hits("ram")}}
    for medium in ("ssd", "remote"):
        out[medium] = {"enabled": False, "hit_blocks": tier_hits(medium)}
    for tier in engine.tiers:
        section = out[tier.medium]
        section["enabled"] = True
        section.update(tier.report())
    return out


def health_report(
    engine: Engine,
    cuda: object,
    recovery: RecoveryReport | None,
    ssd: SsdTier | None = None,
    route: RouteChoice | None = None,
) -> Callable[[], dict[str, object]]:
    """/health's document, read from the HTTP thread: counts only, no
    bookkeeping walk (that is /stats, built on the loop). ssd: the SSD
    tier's files; route: how CUDA engines' SSD hits reach their GPUs."""

    def report() -> dict[str, object]:
        slabs = engine.pool.slabs
        instances = engine.registry.instances
        # A GPU whose CUDA context a sticky fault broke fails every copy until
        # a restart: degraded (HTTP 503) so an orchestrator restarts us.
        faults = dict(getattr(cuda, "faults", {}))
        return {
            "status": "degraded" if faults else "ok",
            "cuda_faults": {str(ordinal): why for ordinal, why in faults.items()},
            "pool_capacity_bytes": engine.pool.size,
            "pool_used_bytes": slabs.used_bytes,
            "resident_blocks": engine.store.resident_ready,
            "namespaces": len(engine.registry.namespaces),
            # list(): one C-level copy; the loop may register meanwhile, and a
            # dict changing size under a Python loop would fail the probe.
            "workers": sum(map(len, [i.workers for i in list(instances.values())])),
            "cuda_mappings": getattr(cuda, "mapped_allocations", 0),
            # starting | ready | failed: why (pegaflow.server.cuda_bringup)
            "cuda_copy_engine": cuda.state() if hasattr(cuda, "state") else "off",
            "cuda_pool_pinning": cuda.pinning() if hasattr(cuda, "pinning") else None,
            "ssd_mode": ssd.mode if ssd else "off",
            "ssd_capacity_bytes": ssd.config.capacity_bytes if ssd else 0,
            "ssd_gpu_route": route.route if route else "off",
            "ssd_gpu_route_reason": route.reason if route else "",
            "pool_file": engine.pool.file is not None,
            "pool_hugepage_share": engine.pool.huge_share,
            "pool_recovered": dataclasses.asdict(recovery) if recovery else None,
        }

    return report
