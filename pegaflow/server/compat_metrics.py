"""The original PegaFlow server's metric names, computed at scrape time from ours.

Dashboards built for the original keep working: each family here is derived
from a series this server exports under its own name (docs/metrics.md maps the
two). Names with no counterpart here (RDMA, per-class eviction accounting,
pinned-for-load refcounts) are not invented; docs/migration.md lists them.
"""

from __future__ import annotations

import concurrent.futures
from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.metrics import MetricWrapperBase

from pegaflow.gds import SsdStats

from .report import Stats

# our hit tiers -> the original's tier label (its cross-node tier is RDMA)
_TIERS = {"ram": "ram", "ssd": "ssd", "remote": "rdma"}


def _value(metric: MetricWrapperBase, **labels: str) -> float:
    """Sum of a counter's or gauge's samples whose labels include `labels`."""
    total = 0.0
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            if all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _histogram(
    name: str,
    text: str,
    source: MetricWrapperBase,
    keep: Callable[[dict[str, str]], tuple[str, ...] | None],
    labels: tuple[str, ...] = (),
) -> HistogramMetricFamily:
    """Re-export a histogram: `keep` maps a sample's labels to the new label
    values (None: dropped); series mapping to the same values are summed."""
    buckets: dict[tuple[str, ...], dict[str, float]] = defaultdict(
        lambda: defaultdict(float)
    )
    sums: dict[tuple[str, ...], float] = defaultdict(float)
    for family in source.collect():
        for s in family.samples:
            key = keep(s.labels)
            if key is None:
                continue
            if s.name.endswith("_bucket"):
                buckets[key][s.labels["le"]] += s.value
            elif s.name.endswith("_sum"):
                sums[key] += s.value
    out = HistogramMetricFamily(name, text, labels=list(labels))
    for key, by_le in buckets.items():
        ordered = sorted(by_le.items(), key=lambda kv: float(kv[0]))
        out.add_metric(list(key), ordered, sum_value=sums[key])
    return out


class OriginalMetrics:
    """The original's names, from our Metrics and the engine's stats snapshot
    (pegaflow.server.report.engine_stats, read on the event loop)."""

    def __init__(self, metrics: object, stats: Callable[[], Stats]) -> None:
        self._m = metrics
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # registered lazily, like HitRateCollector

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield from self._cache(m)
        yield from self._transfers(m)
        yield from self._rpc(m)
        try:
            stats = self._stats()
        except (concurrent.futures.TimeoutError, RuntimeError):
            return  # HitRateCollector logs the same stall once
        yield from self._from_stats(stats)

    @staticmethod
    def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, text, value=value)

    def _cache(self, m: object) -> Iterator[Metric]:
        c = self._counter
        yield c(
            "pegaflow_cache_block_hits",
            "blocks found by prefix queries (ours: pegaflow_query_hit_blocks)",
            _value(m.hits),
        )
        yield c(
            "pegaflow_cache_block_misses",
            "queried blocks past the found prefix (pegaflow_query_miss_blocks)",
            _value(m.misses),
        )
        yield c(
            "pegaflow_cache_block_insertions",
            "blocks copied into the pool by saves (pegaflow_transfer_blocks)",
            _value(m.blocks, direction="save"),
        )
        yield c(
            "pegaflow_cache_block_evictions",
            "blocks evicted from the pool (pegaflow_evictions)",
            _value(m.evictions),
        )
        yield c(
            "pegaflow_pool_alloc_failures",
            "blocks a save found no free slot for (pegaflow_admission_rejections)",
            _value(m.admission_rejections, reason="pool_full"),
        )
        resident = GaugeMetricFamily(
            "pegaflow_cache_resident_blocks",
            "complete blocks in the pool; all local here (pegaflow_resident_blocks)",
            labels=["class"],
        )
        resident.add_metric(["retained"], _value(m.resident_blocks))
        resident.add_metric(["reclaimable"], 0.0)
        yield resident

    def _transfers(self, m: object) -> Iterator[Metric]:
        for d in ("save", "load"):
            yield self._counter(
                f"pegaflow_{d}_bytes",
                f"bytes moved by {d}s (pegaflow_transfer_bytes)",
                _value(m.bytes, direction=d),
            )
            yield _histogram(
                f"pegaflow_{d}_duration_seconds",
                f"copy time of one {d} (pegaflow_transfer_seconds)",
                m.transfer_seconds,
                lambda labels, d=d: () if labels.get("direction") == d else None,
            )
        failed = sum(
            v for code, v in _rpc_counts(m.rpc_seconds, "Load").items() if code != "OK"
        )
        yield self._counter(
            "pegaflow_load_failures", "Load RPCs that did not answer OK", failed
        )
        yield _histogram(
            "pegaflow_ssd_prefetch_duration_seconds",
            "one SSD load, query to last block (pegaflow_ssd_prefetch_seconds)",
            m.ssd.prefetch_seconds,
            lambda labels: (),
        )

    def _rpc(self, m: object) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "pegaflow_rpc_requests",
            "RPCs by method and status, every transport (pegaflow_rpc_seconds_count)",
            labels=["method", "status"],
        )
        counts: dict[tuple[str, str], float] = defaultdict(float)
        for family in m.rpc_seconds.collect():
            for s in family.samples:
                if s.name.endswith("_count"):
                    counts[(s.labels["method"], s.labels["code"])] += s.value
        for (method, code), value in sorted(counts.items()):
            requests.add_metric([method, code], value)
        yield requests
        yield _histogram(
            "pegaflow_rpc_duration_seconds",
            "RPC time by method and status (pegaflow_rpc_seconds)",
            m.rpc_seconds,
            lambda labels: (labels["method"], labels["code"]),
            ("method", "status"),
        )

    def _from_stats(self, stats: Stats) -> Iterator[Metric]:
        tiers = CounterMetricFamily(
            "pegaflow_cache_tier_block_requests",
            "queried blocks by the tier that served them, or miss "
            "(pegaflow_query_blocks, summed over namespaces)",
            labels=["tier"],
        )
        namespaces = stats["namespaces"]
        for ours, theirs in _TIERS.items():
            tiers.add_metric([theirs], sum(ns["hits"][ours] for ns in namespaces))
        tiers.add_metric(["miss"], sum(sum(ns["misses"].values()) for ns in namespaces))
        yield tiers
        yield from _hll(namespaces, stats["hll"]["windows"])
        yield from namespace_info(stats.get("registered", []))


def _rpc_counts(hist: MetricWrapperBase, method: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for family in hist.collect():
        for s in family.samples:
            if s.name.endswith("_count") and s.labels.get("method") == method:
                out[s.labels["code"]] += s.value
    return out


def _hll(namespaces: list[dict], windows: list[str]) -> Iterator[Metric]:
    """The original keeps one HLL per window over (namespace, hash): sums of
    ours over namespaces, the distinct count clamped to the misses as ours."""
    card = GaugeMetricFamily(
        "pegaflow_hll_cardinality",
        "distinct blocks first seen by a missed query, in the window",
        labels=["window"],
    )
    total = GaugeMetricFamily(
        "pegaflow_hll_total_requests", "blocks queried in the window", labels=["window"]
    )
    rate = GaugeMetricFamily(
        "pegaflow_hll_estimated_hit_rate",
        "the infinite cache's hit rate in the window (pegaflow_hit_rate_ceiling)",
        labels=["window"],
    )
    for label in windows:
        wins = [ns["windows"][label] for ns in namespaces if label in ns["windows"]]
        n = sum(w["requests"] for w in wins)
        u = sum(min(w["unique"], w["requests"] - w["hits"]) for w in wins)
        card.add_metric([label], u)
        total.add_metric([label], n)
        rate.add_metric([label], min(1.0, max(0.0, 1 - u / n)) if n else 0.0)
    yield from (card, total, rate)


class OriginalSsdMetrics:
    """The original's SSD counters, from SsdTier.stats()."""

    def __init__(self, stats: Callable[[], SsdStats]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        c = CounterMetricFamily
        yield c(
            "pegaflow_ssd_write_bytes",
            "payload bytes spilled to SSD (pegaflow_ssd_written_bytes)",
            value=st.bytes_written,
        )
        yield c(
            "pegaflow_ssd_prefetch_success",
            "blocks loaded from SSD intact (pegaflow_ssd_load_hit_blocks)",
            value=st.load_hits,
        )
        yield c(
            "pegaflow_ssd_prefetch_failures",
            "blocks asked of the SSD and not loaded (load_blocks - load_hit_blocks)",
            value=max(0, st.load_blocks - st.load_hits),
        )


def namespace_info(registered: list[dict]) -> Iterator[Metric]:
    """pegaflow_namespace_info: what registration tells about each namespace,
    by its tag (never its name)."""
    info = GaugeMetricFamily(
        "pegaflow_namespace_info",
        "registered namespaces: tag -> shards per block (TP size; 1: MLA), "
        "layers, bytes per block and rank",
        labels=["namespace", "shards", "layers", "block_bytes"],
    )
    for ns in registered:
        info.add_metric(
            [ns["tag"], str(ns["shards"]), str(ns["layers"]), str(ns["block_bytes"])],
            1.0,
        )
    yield info
