"""pegaflow.cache.hugepages: the pool's share of 2 MiB pages, read from smaps."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import numpy as np
import pytest

from pegaflow.cache import pool as pool_mod
from pegaflow.cache.hugepages import huge_share, thp_setting
from pegaflow.common.settings import PoolConfig

SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
Private_Hugetlb:       0 kB
VmFlags: rd wr mr mw me ac hg
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
7f1000000000-7f1000400000 rw-p 00000000 00:00 0 /dev/hugepages/pool
Size:               4096 kB
Private_Hugetlb:    4096 kB
"""


def test_the_share_counts_the_mappings_of_the_range(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    base = 0x7F0000000000
    assert huge_share(base, 4 << 20, str(smaps)) == 0.5  # its one mapping
    assert huge_share(base, 8 << 20, str(smaps)) == 0.75  # two: 6 of 8 MiB
    assert huge_share(0x7F1000000000, 4 << 20, str(smaps)) == 1.0  # hugetlbfs
    assert huge_share(0x7E0000000000, 4 << 20, str(smaps)) == 0.0  # none
    assert huge_share(base, 4 << 20, str(tmp_path / "missing")) is None
    smaps.write_text("7f0000000000-7f0000400000 rw-p\nAnonHugePages: lots kB\n")
    assert huge_share(base, 4 << 20, str(smaps)) is None  # unreadable: unknown


def test_the_kernel_setting_is_the_bracketed_word(tmp_path: Path) -> None:
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert thp_setting("enabled", str(tmp_path)) == "madvise"
    assert thp_setting("shmem_enabled", str(tmp_path)) == "unknown"


def test_this_process_memory_is_read() -> None:
    """A private mapping of 4 KiB pages (THP refused for it) reads 0.0 from
    the real smaps: the parser finds the mapping in a live file."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    region = mmap.mmap(-1, 8 << 20, flags=flags)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    mem = np.frombuffer(region, np.uint8)
    mem[::4096] = 1
    assert huge_share(mem.ctypes.data, mem.nbytes) == 0.0
    del mem
    region.close()


@pytest.mark.parametrize(("share", "warned"), [(0.0, True), (0.3, True), (0.9, False)])
def test_a_pool_of_small_pages_is_said_with_the_fix(
    share: float, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    config = PoolConfig(size_bytes=1 << 30)
    with caplog.at_level(logging.WARNING, logger="pegaflow.cache.pool"):
        pool_mod._warn_small_pages(share, 1 << 30, config)
    text = caplog.text
    assert ("--use-hugepages" in text and "transparent hugepages" in text) == warned
