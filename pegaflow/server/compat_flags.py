"""The original PegaFlow `pegaflow-server`'s flags that have no flag of ours,
and our own deprecated flags.

A command line copied from the original's docs keeps working: each flag here is
either translated into our settings (`translate`) or accepted and ignored with
one WARNING line saying why (`IGNORED`). The flags we share with the original
(--addr, --pool-size, --ssd-cache-path, ...) live in pegaflow.cli itself.
Flags of ours on their way out (`DEPRECATED`) are accepted and ignored the same
way for a release, each WARNING line naming what replaces it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

# flag -> (argparse type, or None for a switch; why it is ignored here)
IGNORED: dict[str, tuple[Callable[[str], object] | None, str]] = {
    "--hint-value-size": (str, "it sizes the original's Rust allocator caches"),
    "--disable-numa-affinity": (
        None,
        "the pool is one allocation; there are no per-NUMA-node pools to disable",
    ),
    "--metrics-otel-endpoint": (
        str,
        "there is no OTLP exporter; scrape /metrics (Prometheus) instead",
    ),
    "--metrics-period-secs": (int, "it only paces the OTLP exporter"),
    "--ssd-prefetch-queue-depth": (
        int,
        "SSD reads are issued by the load that needs them; there is no prefetch "
        "queue to bound",
    ),
    "--max-prefetch-blocks": (
        int,
        "a load's SSD reads are bounded by the request caps, not a prefetch budget",
    ),
    "--trace-sample-rate": (float, "there is no OpenTelemetry tracing"),
    "--pool-shards": (int, "the pool's allocator is not sharded"),
    "--blockwise-alloc": (None, "the pool hands out fixed-size slots already"),
    "--qps-per-peer": (
        int,
        "the Mooncake transfer engine sizes its queue pairs (MC_NUM_QP_PER_EP)",
    ),
    "--transfer-lock-timeout-secs": (
        int,
        "remote reads are bounded by --remote-fetch-timeout, and take no lock",
    ),
}

# Our flags that set measured constants (issue 28): ignored for a release,
# then removed. flag -> (argparse type; what replaces it). Their values are
# pegaflow/copiers/measured.py's, with the H200 figures behind each.
DEPRECATED: dict[str, tuple[Callable[[str], object] | None, str]] = {
    "--copy-crossovers": (
        str,
        "where --copy-path auto takes copy engines is a measured table "
        "(pegaflow/copiers/measured.py); --copy-path kernel|dma forces one path",
    ),
    "--copy-contention-ratio": (
        str,
        "--copy-path auto's switch to copy engines on a shared GPU uses a "
        "measured ratio (pegaflow/copiers/measured.py); --copy-path kernel|dma "
        "forces one path",
    ),
    "--copy-wait": (
        str,
        "GPU copies are awaited on the event loop up to a measured length, on "
        "a copy thread past it (pegaflow/copiers/measured.py); nothing "
        "replaces it",
    ),
}

# One write batch of the original counts as this many blocks of our spill
# queue, so its default depth (8) gives our default --ssd-queue-blocks (64).
BLOCKS_PER_WRITE_BATCH = 8
SHARD_NAME = "pegaflow-ssd-{:03d}.cache"  # files in an --ssd-cache-path directory
# The original takes HLL bucket bits up to 18; our registers stop at 16.
MAX_BUCKET_BITS = 16


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_flags(p: argparse.ArgumentParser) -> None:
    """The original's flags without a flag of ours, hidden from --help's list
    (docs/migration.md names each)."""
    g = p.add_argument_group(
        "flags of the original PegaFlow server",
        "accepted so its command lines start unchanged; see docs/migration.md",
    )
    g.add_argument(
        "--enable-prometheus",
        action="store_true",
        help="serve /metrics (it is on unless --no-http)",
    )
    g.add_argument(
        "--ssd-cache-shards",
        type=int,
        default=1,
        help="files per --ssd-cache-path directory (default: 1)",
    )
    g.add_argument(
        "--ssd-write-queue-depth",
        type=int,
        default=None,
        help=f"spill queue in write batches of {BLOCKS_PER_WRITE_BATCH} blocks: "
        "sets --ssd-queue-blocks to DEPTH*8 unless that is given",
    )
    g.add_argument(
        "--ssd-write-inflight",
        type=int,
        default=None,
        help="SSD writes at once: our SSD writer threads (default: 2)",
    )
    g.add_argument(
        "--ssd-prefetch-inflight",
        type=int,
        default=None,
        help="SSD reads at once: our SSD reader threads (default: 4)",
    )
    for flag, (kind, _why) in IGNORED.items():
        if kind is None:
            g.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    for flag, (kind, _why) in DEPRECATED.items():  # ours: in no group, no help
        p.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)


def ignored_warnings(args: argparse.Namespace) -> list[str]:
    """One line per ignored or deprecated flag the command line carries."""
    lines = []
    for table, said in ((IGNORED, "is accepted and ignored"),
                        (DEPRECATED, "is deprecated and ignored")):  # fmt: skip
        for flag, (kind, why) in table.items():
            value = getattr(args, dest(flag))
            if value is not None and value is not False:
                shown = flag if kind is None else f"{flag} {value}"
                lines.append(f"{shown} {said}: {why}")
    return lines


def ssd_paths(paths: list[str], shards: int) -> tuple[str, ...]:
    """--ssd-cache-path values -> data files: a directory holds `shards` files
    (SHARD_NAME), a file path with shards > 1 becomes path.0, path.1, ..."""
    if shards < 1:
        raise ValueError("ssd_cache_shards: must be >= 1")
    out: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            out += [os.path.join(path, SHARD_NAME.format(i)) for i in range(shards)]
        elif shards > 1:
            out += [f"{path}.{i}" for i in range(shards)]
        else:
            out.append(path)
    return tuple(out)


def ssd_queue_blocks(args: argparse.Namespace) -> int:
    if args.ssd_queue_blocks is not None:
        return args.ssd_queue_blocks
    if args.ssd_write_queue_depth is not None:
        return args.ssd_write_queue_depth * BLOCKS_PER_WRITE_BATCH
    return 64


def bucket_bits(args: argparse.Namespace) -> list[str]:
    """Clamp the original's 17/18 bucket bits to ours; the warning line, if any."""
    bits = args.metric_hll_bucket_bits
    if isinstance(bits, int) and MAX_BUCKET_BITS < bits <= 18:
        args.metric_hll_bucket_bits = MAX_BUCKET_BITS
        return [
            f"--metric-hll-bucket-bits {bits}: using {MAX_BUCKET_BITS}, the most "
            "this server's registers take (error ~0.41 %)"
        ]
    return []
