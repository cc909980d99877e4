"""Typed, validated configuration: one frozen dataclass per component, built once
by the CLI (or a test) and passed down. No global config object."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Literal

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

    def __post_init__(self) -> None:
        if self.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s: must be > 0")
        if self.lease_sweep_interval_s <= 0:
            raise ValueError("lease_sweep_interval_s: must be > 0")
        if self.copy_threads < 1:
            raise ValueError("copy_threads: must be >= 1")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    addr: str = "127.0.0.1:50055"
    http_addr: str | None = "127.0.0.1:9091"
    log_level: LogLevel = "info"
    pool: PoolConfig = field(default_factory=PoolConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_message_bytes: int = 64 << 20
    # Unix socket for fast prefix queries: a path, "auto" (a per-server path in
    # the temp directory) or None (off).
    query_socket: str | None = "auto"

    def __post_init__(self) -> None:
        parse_addr(self.addr)
        if self.http_addr is not None:
            parse_addr(self.http_addr)
