"""The remote tier's series on the server's registry: what this node fetched
from peers, what it served them, and every way a fetch became a miss."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from .advertiser import Advertiser, AdvertiserCounters

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


@dataclass(slots=True)
class RemoteStats:
    fetches: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    fetch_seconds: float = 0.0  # sum over fetches
    last_fetch_s: float = 0.0
    # the last fetch's phases, ms: metaserver plan, pin, read (+ hashing it;
    # of it: transfer, the transport's own calls, and hash, the wait for the
    # reader's checksums after the last transfer), checksums_wait, publish
    last_phases_ms: dict[str, float] = field(default_factory=dict)
    peers_seen: set[str] = field(default_factory=set)  # owners fetched from
    quarantined_slots: int = 0  # ever held back after a read failed mid-flight


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


def link_report(
    head: dict[str, object],
    st: RemoteStats,
    metrics: RemoteMetrics,
    adv: Advertiser | None,
) -> dict[str, object]:
    """The remote tier's part of /stats and `pegaflow-server status`, after
    `head` (the link's own fields)."""
    failures = {
        s.labels["cause"]: int(s.value)
        for m in metrics.failures.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    mean = st.fetch_seconds / st.fetches * 1e3 if st.fetches else 0.0
    return head | {
        "joined": adv is not None and adv.joined.is_set(),
        "peers": len(st.peers_seen),
        "fetches": st.fetches,
        "fetched_blocks": st.fetched_blocks,
        "fetched_bytes": st.fetched_bytes,
        "fetch_ms_mean": round(mean, 3),
        "fetch_ms_last": round(st.last_fetch_s * 1e3, 3),
        "fetch_phases_ms_last": st.last_phases_ms,
        "failed_blocks": failures,
        "quarantined_slots": st.quarantined_slots,
        "advertised": adv.counters.advertised if adv else 0,
        "withdrawn": adv.counters.withdrawn if adv else 0,
        "advertise_dropped": adv.counters.dropped if adv else 0,
        "rejoins": adv.counters.rejoins if adv else 0,
    }


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
