"""Typed, validated configuration: one frozen dataclass per component, built once
by the CLI (or a test) and passed down. No global config object."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # built by the CLI; the config module stays import-light
    from pegaflow.gds import SsdConfig

LogLevel = Literal["debug", "info", "warning", "error"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'512mb', '8GB', '1.5g', '64KiB', '4096' -> bytes (binary units, as PegaFlow)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use e.g. 512mb, 8gb, 1tb)")
    number, unit = match.groups()
    scale = _UNITS[(unit or "").lower()[:1]]
    return int(float(number) * scale)


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
    if unit is None or not value > 0:
        raise ValueError(f"not a duration: {text!r} (use e.g. 90s, 15m, 1h, 1d)")
    return value * unit


def format_duration(seconds: float) -> str:
    """The label of a window: the largest unit that divides it (900 -> '15m')."""
    for unit, size in sorted(_DURATIONS.items(), key=lambda u: -u[1]):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class HitRateConfig:
    """HyperLogLog windows of the hit-rate ceiling (see pegaflow.hll)."""

    windows_s: tuple[float, ...] = (900.0, 3600.0, 86400.0)
    # 16 bits: 0.41 % standard error, and a window's 15 sub-window register sets
    # stay under 1 MiB (pegaflow.hll.SUB_WINDOWS).
    bucket_bits: int = 16

    def __post_init__(self) -> None:
        if not self.windows_s or min(self.windows_s) < 1:
            raise ValueError("metric_hll_windows: need windows of >= 1 s")
        if len(set(map(format_duration, self.windows_s))) != len(self.windows_s):
            raise ValueError("metric_hll_windows: duplicate windows")
        if not 4 <= self.bucket_bits <= 16:
            raise ValueError("metric_hll_bucket_bits: must lie in [4, 16]")

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

    def __post_init__(self) -> None:
        if self.size_bytes < 1 << 20:
            raise ValueError(f"pool_size: {self.size_bytes} bytes is below 1 MiB")
        if self.prefault_threads < 1:
            raise ValueError("prefault_threads: must be >= 1")
        if self.slab_bytes < 1 << 16:
            raise ValueError("slab_bytes: must be >= 64 KiB")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    enable_lfu_admission: bool = False
    lease_ttl_s: float = 30.0
    lease_sweep_interval_s: float = 1.0
    copy_threads: int = 2
    # Copies up to this size run on the event loop itself: a hop to a worker
    # thread and back costs more than moving one block (measured ~0.25 ms on VMs).
    inline_copy_bytes: int = 2 << 20
    max_blocks_per_request: int = 65536
    hit_rate: HitRateConfig = field(default_factory=HitRateConfig)
    # Namespaces with no worker but blocks resident that keep their hit-rate
    # state; past this, the longest idle loses it (see pegaflow.namespaces).
    max_idle_namespaces: int = 4096

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s: must be > 0")
        if self.lease_sweep_interval_s <= 0:
            raise ValueError("lease_sweep_interval_s: must be > 0")
        if self.copy_threads < 1:
            raise ValueError("copy_threads: must be >= 1")
        if self.max_idle_namespaces < 0:
            raise ValueError("max_idle_namespaces: must be >= 0")


@dataclass(frozen=True, slots=True)
class CudaConfig:
    """The GPU data path: which devices, how many CTAs per copy direction."""

    enabled: bool = True  # False: host engines only, CUDA is never touched
    devices: tuple[int, ...] | None = None  # None: every visible GPU, if any
    max_ctas: int = 66
    event_timeout_s: float = 10.0  # bound on a save waiting for an engine event

    def __post_init__(self) -> None:
        if self.devices is not None and (not self.devices or min(self.devices) < 0):
            raise ValueError("devices: need CUDA ordinals >= 0")
        if self.max_ctas < 1:
            raise ValueError("max_ctas: must be >= 1")
        if self.event_timeout_s <= 0:
            raise ValueError("event_timeout_s: must be > 0")


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


@dataclass(frozen=True, slots=True)
class ServerConfig:
    addr: str = "127.0.0.1:50055"
    http_addr: str | None = "127.0.0.1:9091"
    log_level: LogLevel = "info"
    pool: PoolConfig = field(default_factory=PoolConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    max_message_bytes: int = 64 << 20
    # Unix socket for fast prefix queries: a path, "auto" (a per-server path in
    # the temp directory) or None (off).
    query_socket: str | None = "auto"
    # The L3 SSD tier (pegaflow.gds.SsdConfig); None: off.
    ssd: SsdConfig | None = None

    def __post_init__(self) -> None:
        parse_addr(self.addr)
        if self.http_addr is not None:
            parse_addr(self.http_addr)
