"""Prometheus metrics of one server, in a registry of its own (tests run several
servers in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from pegaflow.gds import SsdStats
from pegaflow.tiers.ssd_metrics import LATENCY_BUCKETS, SsdTierMetrics

# No `_created` series: one per counter and histogram, noise on every scrape.
disable_created_metrics()


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
        self.block_watchers = Gauge(
            "pegaflow_block_watchers",
            "open WatchBlocks streams (KV events for routers)",
            registry=r,
        )
        self.block_event_resyncs = Counter(
            "pegaflow_block_event_resyncs",
            "WatchBlocks streams that fell behind: backlog dropped, blocks held "
            "sent again",
            registry=r,
        )
        self.tier_rates = Gauge(
            "pegaflow_tier_rate_gbps",
            "recent rate told to connectors with query answers (GB/s, 0 until "
            "measured): l1_<copier> into engines, ssd / remote into L1",
            ["medium"],
            registry=r,
        )
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
        self.lease_capped = Counter(
            "pegaflow_lease_capped_blocks",
            "blocks found but left out of a query's answer: the leases of the "
            "instance's user already pinned its part of --max-leased-share of "
            "the pool",
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
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.socket_refusals = Counter(
            "pegaflow_socket_refusals",
            "unix-socket connections refused, by the bound or rule they broke: "
            "connections, frame_size, partial_frames, backlog (requests and "
            "replies waiting over all connections), timeout (hello or frame "
            "not whole in time), unread (replies unread for 30 s), protocol, share "
            "(descriptor exchange failed)",
            ["reason"],
            registry=r,
        )
        self.socket_dropped = Counter(
            "pegaflow_socket_dropped_requests",
            "requests queued on a unix-socket connection whose client went "
            "away or was refused, dropped undone",
            registry=r,
        )
        self.copy_waits = Counter(
            "pegaflow_copy_waits",
            "copies above inline_copy_bytes by how they were waited for: loop "
            "(launched and awaited on the event loop), late (a thread took the "
            "wait over past the expected end, or no estimate yet), thread; "
            "lane: any host copy through process_vm (its engine's own thread)",
            ["way"],
            registry=r,
        )
        self.loads_in_flight = Counter(
            "pegaflow_loads_in_flight",
            "loads answered as their copy was queued (a GPU worker's "
            "done_event): answered; failed: the copy failed after the answer "
            "(its connection was ended: the engine recomputes those blocks)",
            ["outcome"],
            registry=r,
        )
        self.rpc_seconds = Histogram(
            "pegaflow_rpc_seconds",
            "server-side RPC time, by method, status and transport (grpc, unix)",
            ["method", "code", "transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # (method, code, transport) -> child: see pegaflow.daemon.boundary
        self.rpc_timers: dict[tuple[str, str, str], Histogram] = {}

        self.ssd_hits = Counter(
            "pegaflow_ssd_hit_blocks",
            "blocks a query missed in L1 and found on SSD (loaded into L1, or "
            "leased for a direct read into the engine's GPU blocks)",
            registry=r,
        )
        self.ssd = SsdTierMetrics(r)  # the SSD tier's own (pegaflow.tiers)

        for direction in ("save", "load"):  # export zeros before the first copy
            self.bytes.labels(direction)
            self.blocks.labels(direction)
            self.transfer_seconds.labels(direction)
        for reason in ("tinylfu", "pool_full"):
            self.admission_rejections.labels(reason)
        for way in ("loop", "late", "thread", "lane"):
            self.copy_waits.labels(way)

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


# SsdStats field -> (metric name, help); counters only grow.
_SSD_COUNTERS = {
    "bytes_written": ("pegaflow_ssd_written_bytes", "payload bytes spilled to SSD"),
    "bytes_read": ("pegaflow_ssd_read_bytes", "payload bytes read back from SSD"),
    "blocks_written": ("pegaflow_ssd_written_blocks", "blocks written to SSD"),
    "spills_queued": ("pegaflow_ssd_spills_queued", "evicted blocks queued to SSD"),
    "spills_dropped": ("pegaflow_ssd_spills_dropped", "spills dropped: queue full"),
    "spills_not_admitted": (
        "pegaflow_ssd_spills_not_admitted",
        "spills refused by seen_twice admission (first eviction)",
    ),
    "no_space": ("pegaflow_ssd_no_space", "spills refused: no free SSD space"),
    "write_errors": ("pegaflow_ssd_write_errors", "failed SSD writes"),
    "read_errors": ("pegaflow_ssd_read_errors", "failed SSD reads"),
    "journal_errors": (
        "pegaflow_ssd_journal_errors",
        "failed journal writes (the spill refused, or the block lost at restart)",
    ),
    "checksum_failures": (
        "pegaflow_ssd_checksum_failures",
        "blocks read back with a bad payload checksum (dropped, never loaded)",
    ),
    "header_mismatches": (
        "pegaflow_ssd_header_mismatches",
        "records whose header did not match the index (dropped, never loaded)",
    ),
    "load_blocks": ("pegaflow_ssd_load_blocks", "blocks asked of the SSD"),
    "load_hits": ("pegaflow_ssd_load_hit_blocks", "blocks loaded from SSD intact"),
}
_SSD_GAUGES = {
    "queue_depth": ("pegaflow_ssd_queue_depth", "spills queued or being written"),
    "queue_capacity": ("pegaflow_ssd_queue_capacity", "spill queue bound"),
    "blocks": ("pegaflow_ssd_blocks", "blocks stored on SSD"),
    "stored_bytes": ("pegaflow_ssd_stored_bytes", "payload bytes stored on SSD"),
    "capacity_bytes": ("pegaflow_ssd_capacity_bytes", "SSD cache size"),
}


class SsdCollector:
    """The SSD tier's counters, read from SsdTier.stats() at scrape time (it is
    thread-safe, so the HTTP thread reads it directly)."""

    def __init__(self, stats: Callable[[], SsdStats]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # registered lazily, like HitRateCollector

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        info = InfoMetricFamily("pegaflow_ssd", "SSD tier I/O backend in use")
        info.add_metric([], {"mode": st.mode})
        yield info
        for field, (name, text) in _SSD_COUNTERS.items():
            yield CounterMetricFamily(name, text, value=getattr(st, field))
        for field, (name, text) in _SSD_GAUGES.items():
            yield GaugeMetricFamily(name, text, value=getattr(st, field))


class CopyPathCollector:
    """The GPU copy path's choices (pegaflow.copiers.contention), read from the
    CUDA copy policy's report() at scrape time (it takes its own lock)."""

    def __init__(
        self,
        report: Callable[[], dict],
        faults: Callable[[], dict[int, bool]] | None = None,
    ) -> None:
        """faults: GPU ordinal -> whether a sticky CUDA fault broke it."""
        self._report = report
        self._faults = faults

    def describe(self) -> list[Metric]:
        return []  # registered lazily, like SsdCollector

    def collect(self) -> Iterator[Metric]:
        rep = self._report()
        info = InfoMetricFamily("pegaflow_copy_path", "--copy-path setting")
        info.add_metric([], {"setting": str(rep["setting"])})
        yield info
        dma = GaugeMetricFamily(
            "pegaflow_copy_contended",
            "1 while auto moves this GPU's kernel copies to copy engines "
            "(its kernel copies ran below --copy-contention-ratio)",
            labels=["device"],
        )
        ratio = GaugeMetricFamily(
            "pegaflow_copy_kernel_ratio",
            "recent kernel copy GB/s over the best seen at their size (EWMA)",
            labels=["device"],
        )
        switches = CounterMetricFamily(
            "pegaflow_copy_path_switches",
            "auto's switches between kernels and copy engines, by target",
            labels=["device", "to"],
        )
        probes = CounterMetricFamily(
            "pegaflow_copy_kernel_probes",
            "kernel batches sent while on copy engines, to see if the GPU is idle",
            labels=["device"],
        )
        batches = CounterMetricFamily(
            "pegaflow_copy_batches",
            "GPU copy batches by path",
            labels=["device", "path"],
        )
        moved = CounterMetricFamily(
            "pegaflow_copy_path_bytes",
            "GPU copy bytes by path",
            labels=["device", "path"],
        )
        on_dma = GaugeMetricFamily(
            "pegaflow_copy_classes_on_dma",
            "batch size classes where auto found copy engines faster than "
            "kernels on this GPU (timed on its own copies)",
            labels=["device"],
        )
        race_probes = CounterMetricFamily(
            "pegaflow_copy_race_probes",
            "batches auto sent by the other path to time it against the one it takes",
            labels=["device", "path"],
        )
        for device, gpu in rep.get("devices", {}).items():
            dma.add_metric([device], float(gpu["choice"] == "dma"))
            ratio.add_metric([device], gpu["kernel_ratio"])
            switches.add_metric([device, "dma"], gpu["switches_to_dma"])
            switches.add_metric([device, "kernel"], gpu["switches_to_kernel"])
            probes.add_metric([device], gpu["probes"])
            on_dma.add_metric([device], gpu["classes_on_dma"])
            for path in ("kernel", "dma"):
                batches.add_metric([device, path], gpu["batches"][path])
                moved.add_metric([device, path], gpu["bytes"][path])
                race_probes.add_metric([device, path], gpu["race_probes"][path])
        yield from (dma, ratio, switches, probes, batches, moved, on_dma, race_probes)
        if self._faults is not None:
            broken = GaugeMetricFamily(
                "pegaflow_cuda_faulted",
                "1 once a sticky CUDA fault broke this GPU's context: its copies "
                "fail until the server restarts (/health says degraded)",
                labels=["device"],
            )
            for device, faulted in sorted(self._faults().items()):
                broken.add_metric([str(device)], float(faulted))
            yield broken
