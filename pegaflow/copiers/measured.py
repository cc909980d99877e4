"""The copy path's measured constants, in one table.

Each was measured on the H200 (figures and raw logs in benchmarks/RESULTS.md)
and is not an operator setting: the flags that once set them
(--copy-crossovers, --copy-contention-ratio, --copy-wait) are deprecated and
ignored (pegaflow.server.compat_flags.DEPRECATED). What stays for operators is
`--copy-path auto|kernel|dma`. A re-measurement changes this file, with its
date and the RESULTS.md section that holds the numbers. Tests that need other
values pass them to the classes' constructors (CopyPolicy, ContendedPolicy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pegaflow.common.settings import check_int

if TYPE_CHECKING:
    from .dma import Direction

MAX_PAGES = 1 << 32
CopyPath = Literal["kernel", "dma"]
PATHS: tuple[CopyPath, CopyPath] = ("kernel", "dma")
Completion = Literal["sync", "flag"]


@dataclass(frozen=True, slots=True)
class Crossover:
    """A row of the crossover table: a batch of `direction` with `min_pages`
    to `max_pages` pages of at least `min_page_bytes` each goes to the copy
    engines (DMA) under `--copy-path auto`; kernels move the rest. How each
    path's batch is waited for: COMPLETION, below."""

    direction: Direction
    min_pages: int
    min_page_bytes: int = 0
    max_pages: int = MAX_PAGES

    def __post_init__(self) -> None:
        if self.direction not in ("save", "load"):
            raise ValueError(f"crossover: direction {self.direction!r}")
        check_int("crossover", self.min_pages, 1, MAX_PAGES)
        check_int("crossover", self.min_page_bytes, 0, 1 << 40)
        check_int("crossover", self.max_pages, self.min_pages, MAX_PAGES)

    def covers(self, direction: Direction, pages: int, page_bytes: int) -> bool:
        return (
            direction == self.direction
            and self.min_pages <= pages <= self.max_pages
            and page_bytes >= self.min_page_bytes
        )


# -- where `auto` takes copy engines on an idle GPU -----------------------------
# Measured on the H200 on 2026-12-02 (benchmarks/RESULTS.md, "Copy-path
# constants"; raw: benchmarks/results/copy_path_constants_h200.json: 64 KiB
# pages x 32 layers, random ids, wall clock until the host sees completion).
# Right for an idle GPU; on a busy one kernels slowed an engine's matmul
# 41-48 %, copy engines ~1 % (2026-12-01): that case is CONTENTION_RATIO's.
# - save, N = 1 block: copy engines + mapped flag 112 us P50, block kernel +
#   stream sync 208 us (272 us at the server's 66-CTA cap: 7.7 GB/s). At N = 8
#   the kernel wins (33.2-34.6 vs 24.5 GB/s: 0.49 vs 0.68 ms). Fixed plus
#   per-block costs fitted to N = 1 and 8 cross at 3-4.5 blocks, so copy
#   engines take saves of up to 4 blocks (128 pages); N = 2-4 are
#   interpolated, not measured.
# - save, N >= 64: the kernel (0.89-0.92 of the ceiling) beats copy engines
#   (0.69-0.78) at every N, 2560 included (50.5 vs 43.1 GB/s; the server's own
#   copy time agreed on 2026-12-01: 43-44 GB/s by DMA at 2560, 49-50 by
#   kernel at 640), so the earlier "DMA from 2560 blocks" row is gone.
# - load: kernels at every N; at N = 1 copy engines + flag only tie (161 us).
CROSSOVERS: tuple[Crossover, ...] = (Crossover("save", 1, 64 << 10, max_pages=4 * 32),)

# -- how a batch of each path is waited for (pegaflow.copiers.completion) -----
# From the H200's N = 1 latencies (2026-12-02; benchmarks/RESULTS.md,
# "Copy-path constants"; P50 of call until the host sees completion): copy
# engines + mapped flag 112 us save / 161 load, + stream sync 149 / 164; block
# kernel + stream sync 208 / 161, + mapped flag 208 / 229: a flag helps copy
# engines only.
COMPLETION: dict[CopyPath, Completion] = {"kernel": "sync", "dma": "flag"}
# Larger DMA batches block in the synchronize: ~0.7 ms at the copy engines'
# 24.5 GB/s of N = 8, past which a poll saves nothing worth a busy core.
FLAG_MAX_BYTES = 16 << 20

# -- `auto` on a GPU another process computes on --------------------------------
# A GPU's kernel copies move to copy engines while they run below this share of
# the best GB/s kernel copies of their size reached there (pegaflow.copiers.
# contention; one probe a second switches back at >= (1 + ratio) / 2).
# Measured on the H200 on 2026-12-01 (benchmarks/RESULTS.md, "Copy-path
# constants" and "Engine interference"; first in the lab notebook's "H200 runs of
# 2026-12-01", "Interference"): 640-block kernel copies time-sliced with an
# engine's bf16 matmul ran at 0.52-0.55 of their idle GB/s (client-side
# rates), both directions at once at ~0.5; idle batches vary by a few percent.
# Checked on 2026-12-02 ("H200 runs of 2026-12-02, second session", "Engine
# interference with the contention-aware auto"): with 0.65 the engine lost
# 2.8-4.7 % instead of the kernels' 41-48 %, 0.94-0.98 of the bytes by DMA.
CONTENTION_RATIO = 0.65

# -- where a GPU copy is waited for (pegaflow.copiers.copy_wait) ----------------
# A load, or a save that waits for no engine event, is launched and awaited on
# the server's event loop (no thread hand-off) when its size class's recent
# rate says it ends within this many seconds; longer ones go by a copy thread.
# Measured on the H200 on 2026-12-02 (benchmarks/RESULTS.md, "Copy-path
# constants"; in the lab notebook, `git show deff3fc:benchmarks/RESULTS.md`:
# "H200 runs of 2026-12-02, sixth session", "GPU copies launched and waited
# for on the event loop", and "seventh session", "`--copy-wait loop` against
# `thread`, up to 2560 blocks"): the loop gained 5-14 % at 64 blocks (~3 ms; a thread's
# wake-ups cost 0.24-0.7 ms), and lost 1-7 % on 640- and 2560-block loads
# (27 / 110 ms), where a thread's hand-off is ~1 % of the copy. 8 ms is ~200
# Llama blocks.
LOOP_MAX_S = 8e-3
