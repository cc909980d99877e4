"""The SSD tier's metrics beside its stats (pegaflow.gds SsdStats, exported by
the server's SsdCollector): what the link between L1 and the tier, and the
direct route to the GPU, count and time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Seconds: one request's or one load's latency, 0.1 ms to 5 s.
LATENCY_BUCKETS = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 5,
)  # fmt: skip


class SsdTierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.direct_blocks = Counter(
            "pegaflow_ssd_direct_blocks",
            "blocks a load read from SSD straight into the engine's GPU blocks "
            "(--ssd-gpu-direct), by result: loaded, or failed (gone from the "
            "SSD, damaged, past the deadline: the engine recomputes them)",
            ["result"],
            registry=registry,
        )
        self.direct_seconds = Histogram(
            "pegaflow_ssd_direct_seconds",
            "time of one load's direct SSD reads, issue to the last check",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.spills_refused = Counter(
            "pegaflow_ssd_spills_refused",
            "blocks not given to the SSD writers: half the pool already waits "
            "for them (a seal's write-behind: spilled at its eviction if there "
            "is room then; an evicted block's spill: dropped)",
            registry=registry,
        )
        self.prefetch_seconds = Histogram(
            "pegaflow_ssd_prefetch_seconds",
            "time of one SSD load, from the query that started it to the last block",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        for result in ("loaded", "failed"):  # exported before the first load
            self.direct_blocks.labels(result)
