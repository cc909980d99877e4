"""Configuration of the SSD tier: one frozen dataclass, validated once.

The CLI builds it once into pegaflow.common.settings.ServerConfig.ssd. It stays beside
the tier so pegaflow.common.settings keeps importing nothing heavier than the stdlib.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, get_args

from pegaflow.common.settings import OnMismatch, check_int, check_seconds

from .format import ALIGN, SUPERBLOCK_BYTES, ChecksumName
from .io import BackendName, DirectIO

Admission = Literal["all", "seen_twice"]
GpuDirect = Literal["auto", "on", "off"]  # gds.gpu_route
WriteOn = Literal["seal", "evict"]
MIN_FILE_BYTES = 1 << 20
MAX_CAPACITY_BYTES = 1 << 62  # all files together; file offsets are int64
# [lo, hi] of the integer settings: a typo is refused at start.
_INT_BOUNDS = {
    "queue_blocks": (1, 1 << 20),
    "write_threads": (1, 64),
    "read_threads": (1, 256),
    "ghost_keys": (1, 1 << 26),
    "journal_slack": (2, 1 << 10),
}


@dataclass(frozen=True, slots=True)
class SsdConfig:
    paths: tuple[str, ...]  # one preallocated file each (--ssd-cache-path, repeated)
    capacity_bytes: int  # all files together (--ssd-cache-capacity), split evenly
    backend: BackendName = "auto"
    direct_io: DirectIO = "auto"
    # Payload checksum of new records ("auto": xxh3-64); records of any known
    # algorithm stay readable, each names its own. Not a flag: a config field.
    checksum: ChecksumName = "auto"
    # Files written by another format version or sized for another capacity:
    # reinitialise them (the cached blocks are dropped) or refuse to start.
    on_mismatch: OnMismatch = "reinit"
    # Spills waiting for a writer; past this a spill is dropped and counted.
    queue_blocks: int = 64
    write_threads: int = 2
    read_threads: int = 4
    # "seen_twice": only blocks evicted from L1 a second time go to SSD (a ghost
    # list of keys remembers the first eviction), so one-off prefixes stay out.
    admission: Admission = "all"
    ghost_keys: int = 1 << 16
    # "seal": every block is queued for the SSD when a save publishes it
    # (write-behind: a restart or crash loses only what the queue had not
    # written, and evicting a block already written frees its slots at once).
    # "evict": a block goes to the SSD only when L1 evicts it. With
    # "seen_twice", "seal" writes a block the second time it is saved or hit.
    write_on: WriteOn = "seal"  # measured: benchmarks/RESULTS.md, "SSD tier"
    # SSD hits of CUDA engines read by kvikio straight into their GPU blocks
    # ("direct") or through L1: gds.gpu_route chooses from this at start.
    gpu_direct: GpuDirect = "auto"
    # Data files and the journal are fdatasync'ed at most this often. A process
    # crash loses nothing either way; after a power loss, blocks not yet synced
    # read back as checksum misses.
    sync_interval_s: float = 1.0
    show_progress: bool = True
    # Snapshot the journal once it holds this many times more entries than the
    # live records need.
    journal_slack: int = 4

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("ssd_cache_path: give at least one file")
        if len(set(map(os.path.abspath, self.paths))) != len(self.paths):
            raise ValueError("ssd_cache_path: the same file twice")
        check_int("ssd_cache_capacity", self.capacity_bytes, 0, MAX_CAPACITY_BYTES)
        if self.file_bytes < MIN_FILE_BYTES:
            raise ValueError(
                f"ssd_cache_capacity: {self.capacity_bytes} bytes over "
                f"{len(self.paths)} file(s) leaves under 1 MiB per file"
            )
        for name, (lo, hi) in _INT_BOUNDS.items():
            check_int(f"ssd_{name}", getattr(self, name), lo, hi)
        if self.write_on not in ("seal", "evict"):
            raise ValueError(f"ssd_write_on: {self.write_on!r} is not seal or evict")
        if self.gpu_direct not in get_args(GpuDirect):
            raise ValueError(
                f"ssd_gpu_direct: {self.gpu_direct!r} is not auto, on or off"
            )
        if self.checksum not in get_args(ChecksumName):
            raise ValueError(
                f"ssd_checksum: {self.checksum!r} is not one of "
                f"{', '.join(get_args(ChecksumName))}"
            )
        check_seconds("ssd_sync_interval_s", self.sync_interval_s, 3600.0, zero_ok=True)

    @property
    def file_bytes(self) -> int:
        """Size of each file, superblock included, 4 KiB-aligned."""
        return self.capacity_bytes // len(self.paths) // ALIGN * ALIGN

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - SUPERBLOCK_BYTES

    @property
    def journal_path(self) -> str:
        return f"{self.paths[0]}.journal"
