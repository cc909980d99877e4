"""Typed, validated configuration: one frozen dataclass per component, built once
by the CLI (or a test) and passed down. No global config object."""

from __future__ import annotations

import math
import operator
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # built by the CLI; the config module stays import-light
    pass

LogLevel = Literal["debug", "info", "warning", "error"]
# What a kept file (the pool file, the SSD tier's) whose geometry does not match
# the flags does at start: started over, or the start refused.
OnMismatch = Literal["reinit", "refuse"]


def log_level(text: str) -> str:
    """The original's level names: trace (shown as debug here), warn."""
    text = text.strip().lower()
    return {"trace": "debug", "warn": "warning"}.get(text, text)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def check_int(name: str, value: object, lo: int, hi: int) -> None:
    """ValueError naming `name` unless value is an integer in [lo, hi]."""
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: need an integer, got {value!r}") from None
    if isinstance(value, bool) or not lo <= number <= hi:
        raise ValueError(f"{name}: must lie in [{lo}, {hi}], got {value!r}")


def check_seconds(name: str, value: float, hi: float, zero_ok: bool = False) -> None:
    """ValueError naming `name` unless value is a finite duration: in (0, hi]
    (or [0, hi] with zero_ok). NaN and infinity fail every comparison or the
    bound, so they cannot slip through as "never expires"."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: need a number of seconds, got {value!r}") from None
    low_ok = seconds >= 0 if zero_ok else seconds > 0
    if not (math.isfinite(seconds) and low_ok and seconds <= hi):
        low = "[0" if zero_ok else "(0"
        raise ValueError(f"{name}: must lie in {low}, {hi:g}] s, got {value!r}")


def check_share(name: str, value: float) -> None:
    """ValueError naming `name` unless value is a share in (0, 1]."""
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: need a number, got {value!r}") from None
    if not (math.isfinite(share) and 0 < share <= 1):
        raise ValueError(f"{name}: must lie in (0, 1], got {value!r}")


def parse_size(text: str) -> int:
    """'512mb', '8GB', '1.5g', '64KiB', '4096' -> bytes (binary units, as PegaFlow)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 512mb, 8gb, 1tb)")
    number, unit = match.groups()
    scale = _UNITS[(unit or "").lower()[:1]]
    try:
        size = float(number) * scale
    except OverflowError:  # hundreds of digits: argparse reports ValueError only
        size = math.inf
    if not math.isfinite(size) or size >= 1 << 64:
        raise ValueError(f"not a size: {text!r} is beyond 2^64 bytes")
    return int(size)


def addr_arg(text: str) -> str:
    """An argparse type: `text` if parse_addr takes it (the CLIs' --addr)."""
    import argparse  # the CLIs' concern; config stays import-light

    try:
        parse_addr(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def parse_addr(text: str) -> tuple[str, int]:
    """'host:port' -> (host, port); IPv6 as '[::1]:port'."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"not a host:port address: {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


_DURATIONS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'90s', '15m', '1.5h', '1d' -> seconds."""
    text = text.strip().lower()
    unit = _DURATIONS.get(text[-1:])
    try:
        value = float(text[:-1]) if unit else float("nan")
    except ValueError:
        value = float("nan")
    if unit is None or not 0 < value < math.inf:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 1h, 1d)")
    return value * unit


def format_duration(seconds: float) -> str:
    """The label of a window: the largest unit that divides it (900 -> '15m')."""
    for unit, size in sorted(_DURATIONS.items(), key=lambda u: -u[1]):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


# Upper bounds of the numeric settings: far above any sensible value, low enough
# that a typo (or nan/inf) is refused at start instead of pinning the pool.
MAX_LEASE_TTL_S = 3600.0
MAX_THREADS = 256
MAX_CTAS = 1024
MAX_POOL_BYTES = 1 << 50  # 1 PiB; whether it fits this machine is checked at start
MAX_HLL_WINDOW_S = 366 * 86400.0


@dataclass(frozen=True, slots=True)
class HitRateConfig:
    """HyperLogLog windows of the hit-rate ceiling (see pegaflow.cache.hll)."""

    windows_s: tuple[float, ...] = (900.0, 3600.0, 86400.0)
    # 16 bits: 0.41 % standard error, and a window's 15 sub-window register sets
    # and its kept merge take ~1 MiB (pegaflow.cache.hll.SUB_WINDOWS).
    bucket_bits: int = 16

    def __post_init__(self) -> None:
        if not self.windows_s:
            raise ValueError("metric_hll_windows: need at least one window")
        for window in self.windows_s:
            check_seconds("metric_hll_windows", window, MAX_HLL_WINDOW_S)
            if window < 1:
                raise ValueError("metric_hll_windows: need windows of >= 1 s")
        if len(set(map(format_duration, self.windows_s))) != len(self.windows_s):
            raise ValueError("metric_hll_windows: duplicate windows")
        check_int("metric_hll_bucket_bits", self.bucket_bits, 4, 16)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(map(format_duration, self.windows_s))

    @classmethod
    def parse(cls, windows: str, bucket_bits: int) -> HitRateConfig:
        """From the CLI's '15m,1h,1d' form."""
        spans = tuple(parse_duration(part) for part in windows.split(",") if part)
        return cls(spans, bucket_bits)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    size_bytes: int = 1 << 30
    use_hugepages: bool = False
    prefault_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))
    slab_bytes: int = 64 << 20
    show_progress: bool = True
    # A file that outlives the server (pegaflow.cache.pool_file); None:
    # anonymous memory.
    pool_file: str | None = None
    on_mismatch: OnMismatch = "reinit"
    # Bytes a second a restart's background check of a kept pool file reads
    # at most (pegaflow.server.pool_check); 0: as fast as it can.
    check_rate: int = 0

    def __post_init__(self) -> None:
        check_int("pool_size", self.size_bytes, 0, MAX_POOL_BYTES)
        if self.on_mismatch not in ("reinit", "refuse"):
            raise ValueError(f"pool_on_mismatch: {self.on_mismatch!r}")
        if self.size_bytes < 1 << 20:
            raise ValueError(f"pool_size: {self.size_bytes} bytes is below 1 MiB")
        check_int("prefault_threads", self.prefault_threads, 1, MAX_THREADS)
        check_int("slab_bytes", self.slab_bytes, 1 << 16, 1 << 32)
        if self.check_rate:
            check_int("pool_check_rate", self.check_rate, 1 << 10, MAX_POOL_BYTES)


# L1 eviction (pegaflow.cache.prefix_eviction): plain LRU, or LRU over chain
# leaves (a block leaves after the blocks chained to it).
EvictionSetting = Literal["lru", "prefix"]
EVICTION_SETTINGS: tuple[EvictionSetting, ...] = ("lru", "prefix")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    enable_lfu_admission: bool = False
    eviction: EvictionSetting = "lru"
    lease_ttl_s: float = 30.0
    lease_sweep_interval_s: float = 1.0
    # The share of the pool leases may pin, in equal parts for the users
    # holding them (pegaflow.cache.leases): the rest stays evictable for saves.
    max_leased_share: float = 0.9
    copy_threads: int = 2
    # Copies up to this size run on the event loop itself: a hop to a worker
    # thread and back costs more than moving one block (measured ~0.25 ms on VMs).
    inline_copy_bytes: int = 2 << 20
    max_blocks_per_request: int = 65536
    # Host-memory registration over TCP, where the kernel cannot say which
    # process asks (pegaflow.common.identity): off unless every local user is trusted.
    allow_tcp_host_engines: bool = False
    # Copies above large_request_descriptors rows (6 MiB of table, ~15 MiB at
    # the peak) run at most max_large_requests at once; see
    # pegaflow.common.request_limits.
    max_large_requests: int = 2
    large_request_descriptors: int = 1 << 18
    hit_rate: HitRateConfig = field(default_factory=HitRateConfig)
    # Namespaces with no worker but blocks resident that keep their hit-rate
    # state (0.4 to 3 MiB each); past this, the longest idle loses it (see
    # pegaflow.server.namespaces). 4096 let idle ones hold GiBs.
    max_idle_namespaces: int = 16
    # KV events for routers (pegaflow.server.block_events): WatchBlocks
    # streams open at once, and the block hashes one may have waiting before
    # it is sent a resync instead.
    max_block_watchers: int = 64
    block_events_buffer: int = 1 << 16

    def __post_init__(self) -> None:
        check_seconds("lease_ttl_s", self.lease_ttl_s, MAX_LEASE_TTL_S)
        check_seconds("lease_sweep_interval_s", self.lease_sweep_interval_s, 60.0)
        check_share("max_leased_share", self.max_leased_share)
        check_int("copy_threads", self.copy_threads, 1, MAX_THREADS)
        check_int("inline_copy_bytes", self.inline_copy_bytes, 0, 1 << 30)
        check_int("max_blocks_per_request", self.max_blocks_per_request, 1, 1 << 24)
        check_int("max_large_requests", self.max_large_requests, 1, 1 << 16)
        check_int("max_idle_namespaces", self.max_idle_namespaces, 0, 1 << 24)
        check_int("max_block_watchers", self.max_block_watchers, 0, 1 << 14)
        check_int("block_events_buffer", self.block_events_buffer, 16, 1 << 24)
        if self.eviction not in EVICTION_SETTINGS:
            known = ", ".join(EVICTION_SETTINGS)
            raise ValueError(f"eviction: {self.eviction!r} is not one of {known}")


CopyPathSetting = Literal["auto", "kernel", "dma"]


@dataclass(frozen=True, slots=True)
class CudaConfig:
    """The GPU data path: which devices, how many CTAs per copy direction, and
    whether a batch moves by kernel or copy engine (`copy_path`; "auto" picks
    per batch from the measured constants in pegaflow.copiers.measured: the
    crossover table, and how fast recent kernel copies ran)."""

    enabled: bool = True  # False: host engines only, CUDA is never touched
    devices: tuple[int, ...] | None = None  # None: every visible GPU, if any
    max_ctas: int = 66
    event_timeout_s: float = 10.0  # bound on a save waiting for an engine event
    copy_path: CopyPathSetting = "auto"

    def __post_init__(self) -> None:
        if self.devices is not None and (not self.devices or min(self.devices) < 0):
            raise ValueError("devices: need CUDA ordinals >= 0")
        if self.devices is not None and len(set(self.devices)) < len(self.devices):
            # one GPU twice would get two copy states, the second one winning
            raise ValueError(f"devices: {self.devices} names a GPU twice")
        check_int("max_ctas", self.max_ctas, 1, MAX_CTAS)
        check_seconds("event_timeout_s", self.event_timeout_s, 3600.0)
        if self.copy_path not in ("auto", "kernel", "dma"):
            raise ValueError(f"copy_path: {self.copy_path!r}, need auto|kernel|dma")


def parse_devices(text: str) -> CudaConfig:
    """'auto' (every visible GPU, none is fine), 'none', or '0,1'."""
    text = text.strip().lower()
    if text == "auto":
        return CudaConfig()
    if text == "none":
        return CudaConfig(enabled=False)
    try:
        ordinals = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"not a device list: {text!r} (auto, none or 0,1)") from None
    return CudaConfig(devices=ordinals)
