"""Configuration of the SSD tier: one frozen dataclass, validated once.

The CLI builds it once into pegaflow.config.ServerConfig.ssd. It stays beside
the tier so pegaflow.config keeps importing nothing heavier than the stdlib.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from pegaflow.gds.format import ALIGN, SUPERBLOCK_BYTES, ChecksumName
from pegaflow.gds.io import BackendName, DirectIO

Admission = Literal["all", "seen_twice"]
OnMismatch = Literal["reinit", "refuse"]
MIN_FILE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class SsdConfig:
    paths: tuple[str, ...]  # one preallocated file each (--ssd-cache-path, repeated)
    capacity_bytes: int  # all files together (--ssd-cache-capacity), split evenly
    backend: BackendName = "auto"
    direct_io: DirectIO = "auto"
    checksum: ChecksumName = "auto"  # of new records: blake3 where installed
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
        if self.file_bytes < MIN_FILE_BYTES:
            raise ValueError(
                f"ssd_cache_capacity: {self.capacity_bytes} bytes over "
                f"{len(self.paths)} file(s) leaves under 1 MiB per file"
            )
        for name in ("queue_blocks", "write_threads", "read_threads", "ghost_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"ssd_{name}: must be >= 1")
        if self.sync_interval_s < 0:
            raise ValueError("ssd_sync_interval_s: must be >= 0")
        if self.journal_slack < 2:
            raise ValueError("ssd_journal_slack: must be >= 2")

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
