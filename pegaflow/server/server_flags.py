"""`pegaflow-server`'s flags: the parser, and which flag a settings error
names (pegaflow.server.cli turns the parsed flags into a ServerConfig)."""

from __future__ import annotations

import argparse

from pegaflow import __version__
from pegaflow.common.request_limits import (
    MAX_CONCURRENT_RPCS,
    MAX_REQUEST_BYTES_IN_FLIGHT,
)
from pegaflow.common.settings import (
    EVICTION_SETTINGS,
    CudaConfig,
    EngineConfig,
    HitRateConfig,
    addr_arg,
    log_level,
    parse_devices,
    parse_duration,
    parse_size,
)

from . import compat_flags, remote_flags

# The settings field a ValueError names (pegaflow.common.settings) -> its flag.
FLAG_OF = {
    "pool_size": "--pool-size",
    "prefault_threads": "--prefault-threads",
    "pool_check_rate": "--pool-check-rate",
    "lease_ttl_s": "--lease-ttl",
    "max_leased_share": "--max-leased-share",
    "copy_threads": "--copy-threads",
    "max_ctas": "--copy-ctas",
    "event_timeout_s": "--cuda-event-timeout",
    "metric_hll_windows": "--metric-hll-windows",
    "metric_hll_bucket_bits": "--metric-hll-bucket-bits",
    "ssd_cache_path": "--ssd-cache-path",
    "ssd_cache_capacity": "--ssd-cache-capacity",
    "ssd_queue_blocks": "--ssd-queue-blocks",
    "ssd_cache_shards": "--ssd-cache-shards",
    "ssd_write_threads": "--ssd-write-inflight",
    "ssd_read_threads": "--ssd-prefetch-inflight",
    "remote_transport": "--remote-transport",
    "metaserver_addr": "--metaserver-addr",
    "remote_query_timeout_s": "--remote-query-timeout",
    "remote_fetch_timeout_s": "--remote-fetch-timeout",
    "max_advertise_queue": "--metaserver-queue-depth",
    "peer_token_env": "--peer-token-env",
    "peer_token_file": "--peer-token-file",
    "token": "--peer-token",
    "peer_token": "--peer-token",
    "peer_token_var": "$PEGAFLOW_PEER_TOKEN",
    "max_concurrent_rpcs": "--max-concurrent-rpcs",
    "max_request_bytes_in_flight": "--max-request-bytes-in-flight",
    "max_idle_namespaces": "--max-idle-namespaces",
    "max_block_watchers": "--max-block-watchers",
    "block_events_buffer": "--block-events-buffer",
    "socket": "--socket",
    "remote_quarantine_s": "--remote-quarantine",
}


def flag_message(exc: ValueError) -> str:
    """'lease_ttl_s: must ...' -> 'argument --lease-ttl: must ...' (argparse's
    wording), so the operator sees the flag, not the config field."""
    field, sep, rest = str(exc).partition(": ")
    flag = FLAG_OF.get(field)
    return f"argument {flag}: {rest}" if sep and flag else str(exc)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _devices(text: str) -> CudaConfig:
    try:
        return parse_devices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _windows(text: str) -> tuple[float, ...]:
    try:
        return tuple(parse_duration(part) for part in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pegaflow-server",
        description="External KV-cache server for LLM inference engines.",
        epilog="'pegaflow-server status [--http-addr ADDR]' shows a running "
        "server's pool, tiers, hit rates and miss causes.",
    )
    p.add_argument(
        "--addr",
        type=addr_arg,
        default="127.0.0.1:50055",
        help="gRPC listen address (default: %(default)s, loopback)",
    )
    p.add_argument(
        "--http-addr",
        type=addr_arg,
        default="127.0.0.1:9091",
        help="/health and /metrics address (default: %(default)s, loopback; "
        "the original PegaFlow listens on 0.0.0.0:9091: give that to expose it)",
    )
    p.add_argument("--no-http", action="store_true", help="do not serve HTTP")
    p.add_argument(
        "--pool-size",
        type=_size,
        default=_size("1gb"),
        help="L1 host pool size, e.g. 512mb, 64gb, 1tb (default: 1gb; the "
        "original PegaFlow's is 30gb)",
    )
    p.add_argument(
        "--use-hugepages",
        action="store_true",
        help="back the pool with reserved 2 MiB hugepages",
    )
    p.add_argument(
        "--pool-file",
        default=None,
        help="keep the pool in this file (under /dev/shm, or on a hugetlbfs "
        "mount with --use-hugepages): a restarted server serves its blocks",
    )
    p.add_argument(
        "--pool-on-mismatch",
        choices=["reinit", "refuse"],
        default="reinit",
        help="a --pool-file of another format or size: start it afresh or "
        "refuse to start (default: reinit)",
    )
    p.add_argument(
        "--pool-check-rate",
        type=_size,
        default=0,
        help="bytes a second a restarted server's background checksum pass "
        "over a kept --pool-file reads at most, e.g. 2gb (at least 1kb; "
        "default: no cap); blocks a query asks for are checked at once",
    )
    p.add_argument(
        "--enable-lfu-admission",
        action="store_true",
        help="TinyLFU admission: keep hot blocks through scans",
    )
    p.add_argument(
        "--eviction",
        choices=EVICTION_SETTINGS,
        default="lru",
        help="L1 eviction: lru, or prefix (LRU over chain tails: a block leaves "
        "after the blocks chained to it; README, 'Eviction', says why lru is the "
        "default) (default: lru)",
    )
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=30.0,
        help="seconds a query's lease pins its blocks (default: 30)",
    )
    p.add_argument(
        "--max-leased-share",
        type=float,
        default=0.9,
        help="share of the pool, in (0, 1], that leases may pin at once, an "
        "equal part of it for each user holding leases; a query past its "
        "user's part is answered a shorter hit (default: 0.9)",
    )
    p.add_argument(
        "--copy-threads",
        type=int,
        default=2,
        help="threads moving bytes for host engines (default: 2)",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=int,
        default=MAX_CONCURRENT_RPCS,
        help="RPCs served at once, each engine worker's session stream "
        "included; more get RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes-in-flight",
        type=_size,
        default=MAX_REQUEST_BYTES_IN_FLIGHT,
        help="bytes of large request bodies (64 KiB or more) worked on at once; "
        "one more gets RESOURCE_EXHAUSTED (default: 256mb)",
    )
    p.add_argument(
        "--prefault-threads",
        type=int,
        default=None,
        help="threads pre-touching the pool (default: min(8, cpus))",
    )
    p.add_argument(
        "--devices",
        type=_devices,
        default=CudaConfig(),
        help="CUDA devices for GPU engines: 'auto' (every visible GPU, none "
        "needed), 'none' (host engines only) or ordinals '0,1' (default: auto)",
    )
    p.add_argument(
        "--copy-sm-cap",
        "--copy-ctas",
        dest="copy_ctas",
        type=int,
        default=66,
        help="CUDA blocks (one SM each) per copy direction for copy kernels: "
        "leaves SMs to engines (default: 66)",
    )
    p.add_argument(
        "--copy-path",
        choices=("auto", "kernel", "dma"),
        default="auto",
        help="kernels, copy engines (cuMemcpyBatchAsync: no SMs), or auto: "
        "per batch from a measured table, and copy engines while another "
        "process computes on the GPU (pegaflow/copiers/measured.py; default: "
        "auto)",
    )
    p.add_argument(
        "--cuda-event-timeout",
        type=float,
        default=10.0,
        help="seconds a save waits for an engine's CUDA event (default: 10)",
    )
    p.add_argument(
        "--metric-hll-windows",
        type=_windows,
        default="15m,1h,1d",
        help="rolling windows of the hit-rate ceiling, e.g. 15m,1h,1d "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--metric-hll-bucket-bits",
        type=int,
        default=HitRateConfig().bucket_bits,
        help="HyperLogLog registers: 2**N per sub-window, N in 4..16; error "
        "~1.04/2**(N/2) (default: %(default)s)",
    )
    p.add_argument(
        "--max-idle-namespaces",
        type=int,
        default=EngineConfig().max_idle_namespaces,
        help="namespaces with no engine but blocks in the pool that keep their "
        "hit-rate state; past it the longest idle loses it (default: %(default)s)",
    )
    p.add_argument(
        "--max-block-watchers",
        type=int,
        default=EngineConfig().max_block_watchers,
        help="KV event streams (WatchBlocks, one per engine and KV cache part) "
        "open at once; more get RESOURCE_EXHAUSTED (default: %(default)s)",
    )
    p.add_argument(
        "--block-events-buffer",
        type=int,
        default=EngineConfig().block_events_buffer,
        help="block hashes a KV event stream may have unsent before it is sent "
        "a resync instead (default: %(default)s)",
    )
    p.add_argument(
        "--socket",
        "--query-socket",  # its name before it carried more than queries
        dest="socket",
        default="auto",
        help="the server's unix socket (registrations, queries, saves, loads; "
        "host engines must register over it): a path, 'auto' (temp dir, per "
        "server) or 'off' (default: auto). --query-socket is the old name",
    )
    p.add_argument(
        "--allow-tcp-host-engines",
        action="store_true",
        help="accept host-memory registrations over TCP from processes of the "
        "caller's own uid (connections from this host only). Off: over TCP the "
        "kernel cannot say which process asks, so host engines register over "
        "the unix socket",
    )
    p.add_argument(
        "--allow-remote-engines",
        action="store_true",
        help="accept engine RPCs (register, query, save, load, session) over "
        "gRPC from other hosts or network namespaces. Off: with a routable "
        "--addr (peers on) they are refused, or any host could probe and lease "
        "what an instance has cached; engines use the unix socket or loopback",
    )
    _ssd_flags(p)
    p.add_argument(
        "--progress",
        action="store_true",
        help="progress bars even when stderr is not a terminal (default: only "
        "on a terminal, so service logs get no \\r frames)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument(
        "--log-level",
        type=log_level,
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="debug, info, warning (or warn), error; trace is debug "
        "(default: %(default)s)",
    )
    p.add_argument("-V", "--version", action="version", version=__version__)
    remote_flags.add_flags(p)
    compat_flags.add_flags(p)
    return p


def _ssd_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ssd-cache-path",
        action="extend",
        nargs="+",
        default=None,
        help="file or directory of the L3 SSD cache; several, or the flag "
        "repeated, for several disks; a directory holds --ssd-cache-shards "
        "files (default: off)",
    )
    p.add_argument(
        "--ssd-cache-capacity",
        type=_size,
        default=None,
        help="SSD cache size over all its files, e.g. 512gb (units as --pool-size; "
        "default with --ssd-cache-path: 512gb)",
    )
    p.add_argument(
        "--ssd-backend",
        choices=["auto", "posix", "kvikio"],
        default="auto",
        help="SSD I/O: kvikio (GDS or its compat mode) needs a CUDA driver; "
        "auto picks it where one is, else posix (default: auto)",
    )
    p.add_argument(
        "--ssd-direct-io",
        choices=["auto", "on", "off"],
        default="auto",
        help="O_DIRECT for the posix backend; auto falls back where the "
        "filesystem refuses it (default: auto)",
    )
    p.add_argument(
        "--ssd-admission",
        choices=["all", "seen_twice"],
        default="all",
        help="write every block to SSD, or only one seen twice (with "
        "--ssd-write-on seal: saved or hit a second time; evict: evicted a "
        "second time) (default: all)",
    )
    p.add_argument(
        "--ssd-write-on",
        choices=["seal", "evict"],
        default="seal",
        help="queue a block for the SSD when a save completes it (write-behind: "
        "it survives a restart, and its eviction frees its slots at once) or "
        "only when L1 evicts it (default: seal; see the README)",
    )
    p.add_argument(
        "--ssd-gpu-direct",
        choices=["auto", "on", "off"],
        default="auto",
        help="read a CUDA engine's SSD hits with kvikio straight into its GPU "
        "blocks, skipping L1 (TP 1 or MLA): auto where GPUDirect Storage is "
        "present; on also in kvikio's compatibility mode, where it measured "
        "slower (default: auto)",
    )
    p.add_argument(
        "--ssd-queue-blocks",
        type=int,
        default=None,
        help="blocks waiting for the SSD writers; past this a block's write is "
        "dropped and counted, never waited for (default: 64)",
    )
    p.add_argument(
        "--ssd-on-mismatch",
        choices=["reinit", "refuse"],
        default="reinit",
        help="SSD files of another format or capacity: start them afresh or "
        "refuse to start (default: reinit)",
    )
