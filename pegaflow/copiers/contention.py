"""Whether another CUDA context computes on a GPU, read from our own copy times,
and `--copy-path auto` moving to copy engines while it does.

On the H200 (benchmarks/RESULTS.md, "Interference", 2026-12-01) copy kernels
of the server's context and an engine's bf16 matmul in another context
time-slice: the matmul lost 41-48 % at any CTA cap (16 to 132) and the kernels
fell to 22-33 GB/s, while copy engines cost it 0.3-1.5 % and moved 31 / 41 / 67
GB/s (save / load / both). On an idle GPU kernels are faster. Time-slicing
shows in the kernels' own speed: a kernel batch that shares the GPU with
another context's kernels runs at about half its idle rate, so that rate is
the signal (no NVML, nothing the engine has to tell us).

`Contention` (one per GPU) keeps, per direction and size class (log2 of the
page and of the batch bytes), the best kernel GB/s seen there. Each kernel
batch of at least `min_pages` pages and `min_bytes` that ran alone on its
stream gives a ratio, its rate over the best rate of its class or a smaller
one (kernels get faster with size, so a smaller class's best understates the
reference: contention is then missed, never invented). A class's first
sample only calibrates. An EWMA of the ratios below `ratio` switches the GPU
to copy engines; from then on one eligible batch per `probe_s` still goes by
kernel, and one probe at or above the midpoint between `ratio` and 1 switches
back. The gap between the two thresholds is the hysteresis: ratios between
them never switch either way. Batches below the size bounds follow the
current choice and never decide it (launch latency swamps their rate).

Both directions feed one decision per GPU: a context that computes slows our
saves and loads alike, and one probe per `probe_s` (not one per direction)
bounds what probing costs the engine. Our own saves and loads by kernel at
once also share the GPU and look half as fast; copy engines moved more there
on an idle GPU too (71 vs 61 GB/s, the same run), so switching is right.

While the pool is still being pinned, batches are counted but not timed:
the pinning threads hold the driver's lock for whole cudaHostRegister calls,
so a batch's time then may be that wait (seen on fresh H100 hosts: the first
servers' 64-block loads were sent to copy engines at 17-22 GB/s).

Known gap: a class whose every sample came while another context computed
(a server started under load, no idle moment since) has a contended best and
sees no contention there until a smaller class gives a higher reference.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from pegaflow.common.geometry import Transfers

from . import measured
from .path_choice import CopyDirection, CopyPath, CopyPolicy, page_class, timed
from .path_race import PathRace

if TYPE_CHECKING:
    from pegaflow.common.settings import CudaConfig

    from .measured import Crossover

T = TypeVar("T")

# The switching ratio: measured.CONTENTION_RATIO (the H200's figures are there).
PROBE_S = 1.0  # a contended 640-block kernel probe (~60 ms) shares 6 % of a second
ALPHA = 0.5  # two contended samples in a row switch; one outlier does not
CLASSES = 64  # log2 of a batch's bytes


def check_ratio(ratio: float) -> None:
    if not 0 < ratio < 1:
        raise ValueError(f"contention_ratio: {ratio!r}, need 0 < ratio < 1")


class Contention:
    """One GPU's choice between kernels and copy engines for batches the
    crossover table gives to kernels. Thread-safe: copy threads call
    choose() and observe(), the HTTP thread report()."""

    def __init__(
        self,
        ratio: float = measured.CONTENTION_RATIO,
        probe_s: float = PROBE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_ratio(ratio)
        self.enter = ratio
        self.exit = (1 + ratio) / 2
        self.probe_s = probe_s
        self._clock = clock
        self._lock = threading.Lock()
        self.choice: CopyPath = "kernel"
        self.estimate = 1.0  # EWMA of the ratios while on kernels
        self.switches: dict[CopyPath, int] = {"kernel": 0, "dma": 0}  # to each
        self.probes = 0
        self.batches: dict[CopyPath, int] = {"kernel": 0, "dma": 0}
        self.bytes: dict[CopyPath, int] = {"kernel": 0, "dma": 0}
        self._best: dict[tuple[CopyDirection, int], np.ndarray] = {}
        self._last_end: dict[CopyDirection, float] = {}
        self._last_probe = -math.inf

    def choose(self, pages: int, nbytes: int) -> CopyPath:
        """The path of a batch the crossover table gives to kernels."""
        with self._lock:
            if self.choice == "kernel":
                return "kernel"
            now = self._clock()
            if timed(pages, nbytes) and now - self._last_probe >= self.probe_s:
                self._last_probe = now
                self.probes += 1
                return "kernel"
            return "dma"

    def observe(
        self,
        direction: CopyDirection,
        path: CopyPath,
        pages: int,
        nbytes: int,
        start: float,
        end: float,
        gpu_s: float | None = None,
        trusted: bool = True,
    ) -> bool:
        """A batch of this GPU finished: queued at `start`, seen done at `end`
        (perf_counter seconds), `gpu_s` its GPU time where events timed it
        (else end - start). One that started before the previous batch of
        its stream ended waited behind it: counted, not timed; so is one
        that is not `trusted`. Returns whether it ran alone (its time is its
        own)."""
        with self._lock:
            self.batches[path] += 1
            self.bytes[path] += nbytes
            alone = start >= self._last_end.get(direction, -math.inf)
            self._last_end[direction] = max(end, self._last_end.get(direction, end))
            seconds = end - start if gpu_s is None else gpu_s
            if path != "kernel" or not alone or not trusted or seconds <= 0:
                return alone and trusted
            if not timed(pages, nbytes):
                return alone
            rate = nbytes / seconds
            best = self._best.setdefault(
                (direction, page_class(pages, nbytes)), np.zeros(CLASSES)
            )
            size = min(nbytes.bit_length(), CLASSES - 1)
            reference = float(best[: size + 1].max())
            best[size] = max(best[size], rate)
            if reference > 0:  # a class's first sample only calibrates
                self._judge(min(rate / reference, 1.0))
            return alone

    def _judge(self, ratio: float) -> None:
        if self.choice == "kernel":
            self.estimate = ALPHA * ratio + (1 - ALPHA) * self.estimate
            if self.estimate < self.enter:
                self.choice = "dma"
                self.switches["dma"] += 1
                self._last_probe = self._clock()
        elif ratio >= self.exit:  # a probe (or a kernel batch still in flight)
            self.choice = "kernel"
            self.switches["kernel"] += 1
            self.estimate = ratio

    def report(self) -> dict[str, object]:
        with self._lock:
            return {
                "choice": self.choice,
                "kernel_ratio": round(self.estimate, 3),
                "switches_to_dma": self.switches["dma"],
                "switches_to_kernel": self.switches["kernel"],
                "probes": self.probes,
                "batches": dict(self.batches),
                "bytes": dict(self.bytes),
            }


class ContendedPolicy(CopyPolicy):
    """CopyPolicy "auto": of the batches the crossover table gives to kernels,
    a size class where copy engines proved faster on this GPU goes to them
    (path_race.PathRace), and the rest move to copy engines while
    `Contention` sees another context computing."""

    def __init__(
        self,
        crossovers: tuple[Crossover, ...] = (),
        ratio: float = measured.CONTENTION_RATIO,
        probe_s: float = PROBE_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__("auto", crossovers)
        check_ratio(ratio)
        self._make = lambda: Contention(ratio, probe_s, clock=clock)
        self._make_race = lambda: PathRace(clock=clock)
        self.ratio = ratio
        self.gpus: dict[int, Contention] = {}
        self.races: dict[int, PathRace] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: CudaConfig) -> CopyPolicy:
        """The server's policy: this one, on the measured table and ratio,
        for "auto"; the plain forced path for "kernel" or "dma"."""
        if config.copy_path != "auto":
            return CopyPolicy.from_config(config)
        return cls(measured.CROSSOVERS, measured.CONTENTION_RATIO)

    def _gpu(self, device: int) -> Contention:
        return self._per_device(self.gpus, device, self._make)

    def _race(self, device: int) -> PathRace:
        return self._per_device(self.races, device, self._make_race)

    def _per_device(self, table: dict[int, T], device: int, make: Callable[[], T]) -> T:
        """The device's entry, made on first use (copy threads race here)."""
        entry = table.get(device)
        if entry is None:
            with self._lock:
                entry = table.setdefault(device, make())
        return entry

    def choose_for(
        self, direction: CopyDirection, t: Transfers, device: int = 0
    ) -> CopyPath:
        path = super().choose_for(direction, t, device)
        if path == "dma":
            return path
        raced = self._race(device).choose(direction, len(t), t.total_bytes)
        if raced is not None:
            return raced
        return self._gpu(device).choose(len(t), t.total_bytes)

    def observe(
        self,
        device: int,
        direction: CopyDirection,
        path: CopyPath,
        t: Transfers,
        start: float,
        end: float,
        gpu_s: float | None = None,
        trusted: bool = True,
    ) -> None:
        """The race compares GPU times where both paths have them: a thread's
        wall-clock time carries its launch and wake-up, which a launched
        batch's events leave out, and would bias a size class the loop and
        the threads both serve towards whichever path the loop took."""
        gpu = self._gpu(device)
        n, nbytes = len(t), t.total_bytes
        if gpu.observe(direction, path, n, nbytes, start, end, gpu_s, trusted):
            seconds = end - start if gpu_s is None else gpu_s
            self._race(device).observe(direction, path, n, nbytes, seconds)

    def report(self) -> dict[str, object]:
        gpus = {
            str(d): {**g.report(), **self._race(d).report()}
            for d, g in sorted(self.gpus.items())
        }
        return {"setting": "auto", "contention_ratio": self.ratio, "devices": gpus}
