"""Prometheus metrics of one server, in a registry of its own (tests run several
servers in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1,
    5,
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pool_capacity = Gauge(
            "pegaflow_pool_capacity_bytes", "L1 pool size", registry=r
        )
        self.pool_used = Gauge(
            "pegaflow_pool_used_bytes", "L1 bytes in allocated slots", registry=r
        )
        self.resident_blocks = Gauge(
            "pegaflow_resident_blocks", "complete blocks in L1", registry=r
        )
        self.leases = Gauge("pegaflow_active_leases", "leases held", registry=r)
        self.instances = Gauge(
            "pegaflow_registered_workers", "registered engine workers", registry=r
        )
        self.hits = Counter(
            "pegaflow_query_hit_blocks", "blocks found by prefix queries", registry=r
        )
        self.misses = Counter(
            "pegaflow_query_miss_blocks",
            "queried blocks beyond the resident prefix",
            registry=r,
        )
        self.evictions = Counter(
            "pegaflow_evictions", "blocks evicted from L1", registry=r
        )
        self.admission_rejections = Counter(
            "pegaflow_admission_rejections",
            "saves refused by TinyLFU or a full pool",
            ["reason"],
            registry=r,
        )
        self.bytes = Counter(
            "pegaflow_transfer_bytes", "bytes moved", ["direction"], registry=r
        )
        self.blocks = Counter(
            "pegaflow_transfer_blocks", "blocks moved", ["direction"], registry=r
        )
        self.transfer_seconds = Histogram(
            "pegaflow_transfer_seconds",
            "copy time of one Save or Load",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "pegaflow_rpc_seconds",
            "server-side RPC time",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

        for direction in ("save", "load"):  # export zeros before the first copy
            self.bytes.labels(direction)
            self.blocks.labels(direction)
            self.transfer_seconds.labels(direction)
        for reason in ("tinylfu", "pool_full"):
            self.admission_rejections.labels(reason)

    def bind_gauges(
        self,
        capacity: int,
        used: Callable[[], float],
        resident: Callable[[], float],
        leases: Callable[[], float],
        workers: Callable[[], float],
    ) -> None:
        self.pool_capacity.set(capacity)
        self.pool_used.set_function(used)
        self.resident_blocks.set_function(resident)
        self.leases.set_function(leases)
        self.instances.set_function(workers)
