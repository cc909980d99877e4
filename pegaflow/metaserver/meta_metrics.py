"""The metaserver's Prometheus registry: index counters read at scrape time
(the request path only bumps plain ints), and per-RPC timings."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .directory import Directory

disable_created_metrics()  # no `_created` series: noise on every scrape

_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 1, 5)
DROP_REASONS = ("ttl", "stale_node", "fenced", "left", "owner_slots", "removed")
NODE_EVENTS = ("joined", "fenced", "stale", "left")


class MetaMetrics:
    """What pegaflow.daemon.boundary.guarded times requests into (rpc_seconds and its
    cached children), plus the index's own series."""

    def __init__(self, directory: Directory) -> None:
        self.registry = CollectorRegistry()
        self.rpc_seconds = Histogram(
            "pegaflow_meta_rpc_seconds",
            "metaserver RPC latency by method and status",
            ["method", "code", "transport"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.rpc_timers: dict[tuple[str, str, str], object] = {}
        self.registry.register(IndexCollector(directory))


class IndexCollector(Collector):
    def __init__(self, directory: Directory) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Metric]:
        d, index = self.directory, self.directory.index
        counters = index.counters
        for name, doc, value in (
            ("entries", "(block, owner) entries held", index.entries),
            ("max_entries", "--max-entries", index.max_entries),
            ("blocks", "blocks with at least one owner", index.blocks),
            ("namespaces", "namespaces with at least one block", index.namespaces),
            ("nodes", "nodes joined and not yet dropped", len(d.nodes)),
        ):
            yield GaugeMetricFamily(f"pegaflow_meta_{name}", doc, value=value)
        for name, doc, value in (
            ("inserted_entries", "entries new to the index", counters.inserted),
            ("refreshed_entries", "inserts of entries held", counters.refreshed),
            (
                "evicted_entries",
                "entries evicted by --max-entries, oldest first",
                counters.evicted,
            ),
            ("queries", "prefix queries answered", d.queries),
            ("query_hashes", "hashes asked about in prefix queries", d.query_hashes),
            ("query_matched", "hashes a prefix plan covered", d.query_matched),
        ):
            yield CounterMetricFamily(f"pegaflow_meta_{name}", doc, value=value)
        dropped = CounterMetricFamily(
            "pegaflow_meta_dropped_entries",
            "entries dropped other than by eviction, by reason",
            labels=["reason"],
        )
        for reason in DROP_REASONS:
            dropped.add_metric([reason], counters.dropped[reason])
        yield dropped
        events = CounterMetricFamily(
            "pegaflow_meta_node_events", "node joins and drops", labels=["event"]
        )
        for event in NODE_EVENTS:
            events.add_metric([event], d.node_events[event])
        yield events
