"""How much of a range of this process's memory sits on 2 MiB pages.

The pool asks for transparent hugepages (pegaflow.cache.pool, madvise). A kernel
whose THP setting refuses that, or a VM that cannot find 2 MiB of contiguous
memory (the H200 test host, 2026-12-03: `enabled [madvise]`, yet not one
huge page), hands out 4 KiB pages without a word, and host-engine copies run
~4x slower from them. The share is read once, after the pool is touched,
from /proc/self/smaps: anonymous THP, shared-memory THP (a --pool-file in
/dev/shm) and hugetlbfs pages (--use-hugepages) all count.
"""

from __future__ import annotations

SMAPS = "/proc/self/smaps"
THP_SETTINGS = "/sys/kernel/mm/transparent_hugepage"
# smaps fields, in kB, of memory on pages of 2 MiB or more
HUGE_FIELDS = frozenset(
    ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Shared_Hugetlb",
     "Private_Hugetlb")
)  # fmt: skip


def huge_share(base: int, size: int, smaps: str = SMAPS) -> float | None:
    """Bytes of [base, base + size) on huge pages, over `size` (mappings that
    reach past the range count whole: at most 1.0); None where smaps cannot
    be read."""
    if size <= 0:
        return None
    huge, inside = 0, False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):  # a mapping's line
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < base + size and hi > base
                elif inside and head[:-1] in HUGE_FIELDS:
                    huge += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return min(1.0, huge / size)


def thp_setting(name: str = "enabled", root: str = THP_SETTINGS) -> str:
    """The kernel's THP mode in brackets ("madvise"), or "unknown"."""
    try:
        with open(f"{root}/{name}") as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"
