"""The remote tier's series on the server's registry: what this node fetched
from peers, what it served them, and every way a fetch became a miss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from .advertiser import AdvertiserCounters

# Why a block the metaserver named was not fetched (each counted in blocks).
FAILURE_CAUSES = (
    "metaserver",  # the metaserver did not answer in time
    "peer_unreachable",  # Pin failed: dead, slow, refused (token) or unknown
    "peer_evicted",  # the peer no longer had it ready
    "geometry",  # the peer answered another slot size or shard count
    "pin_expired",  # no time left of the peer's hold to read in
    "transport",  # the one-sided read failed (peer died mid-read)
    "checksum",  # the bytes read did not match the peer's checksums
    "deadline",  # the fetch outlived --remote-fetch-timeout
    "no_slot",  # no local L1 slot could be freed for it
    "quarantine",  # too many slots held back from failed reads (see link.py)
)
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


class RemoteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits = Counter(
            "pegaflow_remote_hit_blocks",
            "blocks a query missed locally and fetched from a peer",
            registry=r,
        )
        self.bytes = Counter(
            "pegaflow_remote_fetch_bytes", "bytes read from peers", registry=r
        )
        self.fetch_seconds = Histogram(
            "pegaflow_remote_fetch_seconds",
            "one remote fetch, from the query that started it to the last block "
            "checked and published",
            buckets=_BUCKETS,
            registry=r,
        )
        self.failures = Counter(
            "pegaflow_remote_failed_blocks",
            "blocks the metaserver named that were not fetched, by cause",
            ["cause"],
            registry=r,
        )
        for cause in FAILURE_CAUSES:
            self.failures.labels(cause)
        self.served_blocks = Counter(
            "pegaflow_remote_served_blocks",
            "blocks pinned here for peers to read",
            registry=r,
        )
        self.pins = Gauge(
            "pegaflow_remote_pins", "pins held here for readers on peers", registry=r
        )
        self.quarantined = Counter(
            "pegaflow_remote_quarantined_slots",
            "local slots held back after a read failed with bytes in flight",
            registry=r,
        )
        self.retries = Counter(
            "pegaflow_remote_read_retries",
            "one-sided reads refused at submission and read again successfully",
            registry=r,
        )


class AdvertiserCollector:
    """The advertiser thread's counters, read at scrape time."""

    def __init__(self, counters: Callable[[], AdvertiserCounters]) -> None:
        self._counters = counters

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        for f in fields(c):
            yield CounterMetricFamily(
                f"pegaflow_metaserver_{f.name}",
                f"hashes/events of this node's metaserver advertising: {f.name}",
                value=getattr(c, f.name),
            )
