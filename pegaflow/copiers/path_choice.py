"""Which path moves a GPU batch, and how its completion is waited for.

`CopyPolicy` picks kernels or copy engines per batch from its direction, page
count and page size (the server passes CudaConfig.copy_path and the H200's
crossover table, pegaflow.copiers.measured.CROSSOVERS); how
pegaflow.copiers.cuda_copier waits for a batch of each path is
measured.COMPLETION. Pure Python: imported without CUDA
(tests/unit/test_copy_policy.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pegaflow.common.geometry import Transfers

from . import dma, measured
from .measured import CopyPath

if TYPE_CHECKING:  # values the server passes in; no import of its config
    from pegaflow.common.settings import CopyPathSetting, CudaConfig

    from .measured import Crossover

CopyDirection = dma.Direction  # save: GPU -> pool, load: pool -> GPU

# Below these a batch's rate is mostly launch and wake-up latency (~0.1 ms of
# copy at 4 MiB): auto times neither its contention nor its race on it.
TIMED_MIN_PAGES = 64
TIMED_MIN_BYTES = 4 << 20


def timed(pages: int, nbytes: int) -> bool:
    """Whether auto learns from this batch's time (contention, path race)."""
    return pages >= TIMED_MIN_PAGES and nbytes >= TIMED_MIN_BYTES


def page_class(pages: int, nbytes: int) -> int:
    """log2 of a batch's page size (+1): batches of one page size are timed
    against each other."""
    return (nbytes // pages).bit_length()


class CopyPolicy:
    """Kernel or copy engines for one batch, from its direction, page count and
    page size: `setting` "kernel" or "dma" forces one, "auto" takes DMA where a
    crossover row of the batch's direction says so (the server passes the
    measured table, from_config; tests pass rows of their own). With no rows,
    "auto" is kernels only."""

    def __init__(
        self, setting: CopyPathSetting = "auto", crossovers: tuple[Crossover, ...] = ()
    ) -> None:
        if setting not in ("auto", "kernel", "dma"):
            raise ValueError(f"copy_path: {setting!r}, need auto|kernel|dma")
        self.setting = setting
        self.crossovers = crossovers

    @classmethod
    def from_config(cls, config: CudaConfig) -> CopyPolicy:
        return cls(config.copy_path, measured.CROSSOVERS)

    def choose(self, direction: CopyDirection, pages: int, page_bytes: int) -> CopyPath:
        if self.setting != "auto":
            return self.setting
        if any(row.covers(direction, pages, page_bytes) for row in self.crossovers):
            return "dma"
        return "kernel"

    def choose_for(
        self, direction: CopyDirection, t: Transfers, device: int = 0
    ) -> CopyPath:
        """choose() for a descriptor table: its rows are the pages. `device`
        (a CUDA ordinal) and observe() serve policies that learn per GPU
        (pegaflow.copiers.contention); this one learns nothing."""
        pages = len(t)
        return self.choose(direction, pages, t.total_bytes // pages if pages else 0)

    def observe(self, device: int, direction: CopyDirection, path: CopyPath,
                t: Transfers, start: float, end: float,
                gpu_s: float | None = None, trusted: bool = True) -> None:  # fmt: skip
        """A batch finished: queued at `start`, seen done at `end`
        (perf_counter); `gpu_s`, where timing events bracketed it, its own
        time on the GPU (no launch, no wait behind the stream's earlier
        work, no wake-up). trusted=False: its times may not be its own (the
        pool was still being pinned): counted, never learnt from."""

    def report(self) -> dict[str, object]:
        return {"setting": self.setting}
