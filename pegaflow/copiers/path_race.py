"""Which copy path is faster on this host, per batch size, learned from the
server's own copies: `--copy-path auto` races copy engines against kernels.

The crossover table (measured.CROSSOVERS) is the H200's: kernels win loads
at every size there. Hosts differ. On a second H100 host (benchmarks/
RESULTS.md, "Small batches", session 12) the copy kernel reached 0.62 of a
memcpy's GB/s where session 10's H100s reached 0.92, and copy engines moved
640-block loads at 46.3 GB/s against the kernel's 33.5. A fixed table cannot
see that; timing both paths on the batches the server moves anyway can.

`PathRace` (one per GPU) keeps, per direction and size class (log2 of the
page and of the batch bytes, as contention.Contention does), the best GB/s
each path reached on batches that ran alone on their stream. Best, not mean:
another context's kernels, queueing and jitter only ever lower a rate, so
the best is the path's speed on this host.

A class starts on kernels. Once it has `samples` kernel batches, its next
eligible batches go by copy engines until it has `samples` of those too
(back to back; past FAST_PROBES probes, batches that never ran alone, one a
`probe_s`). From then on it takes copy engines where their best beats the
kernel's by more than `margin`, and sends the losing path one batch per
`reprobe_s`, so a best measured while the GPU was busy is corrected once it
is idle.

What probing costs: `samples` batches per size class, once, at the slower
path's rate, then one per `reprobe_s` (30 s). Batches below the size bounds
(launch latency swamps their rate) follow the table and are never probes.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .measured import PATHS, CopyPath
from .path_choice import CopyDirection, page_class, timed

PROBE_S = 1.0  # an unsettled class past FAST_PROBES: one probe a second
FAST_PROBES = 12  # an unsettled class's first probes go at once, back to back
REPROBE_S = 30.0  # then the losing path, to keep its best honest
SAMPLES = 3  # of each path before a class decides
MARGIN = 0.10  # copy engines must beat the kernel's best by this much


@dataclass(slots=True)
class SizeClass:
    """One (direction, page class, batch class): each path's best rate and
    how many alone batches gave it."""

    best: dict[CopyPath, float] = field(
        default_factory=lambda: dict.fromkeys(PATHS, 0.0)
    )
    samples: dict[CopyPath, int] = field(
        default_factory=lambda: dict.fromkeys(PATHS, 0)
    )
    last_probe: float = -math.inf
    probes: int = 0

    def settled(self, samples: int) -> bool:
        return min(self.samples.values()) >= samples

    def winner(self, samples: int, margin: float) -> CopyPath:
        if self.settled(samples) and self.best["dma"] > self.best["kernel"] * (
            1 + margin
        ):
            return "dma"
        return "kernel"


ClassKey = tuple[CopyDirection, int, int]


class PathRace:
    """One GPU's per-size-class choice between kernels and copy engines for
    batches the crossover table gives to kernels. Thread-safe: copy threads
    call choose() and observe(), the HTTP thread report()."""

    def __init__(
        self,
        probe_s: float = PROBE_S,
        reprobe_s: float = REPROBE_S,
        samples: int = SAMPLES,
        margin: float = MARGIN,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0 <= margin < 10:
            raise ValueError(f"margin: {margin!r}, need 0 <= margin < 10")
        self.probe_s, self.reprobe_s = probe_s, reprobe_s
        self.samples, self.margin = samples, margin
        self._clock = clock
        self._lock = threading.Lock()
        self._classes: dict[ClassKey, SizeClass] = {}
        self.probes: dict[CopyPath, int] = dict.fromkeys(PATHS, 0)

    def _key(self, direction: CopyDirection, pages: int, nbytes: int) -> ClassKey:
        return direction, page_class(pages, nbytes), nbytes.bit_length()

    def choose(
        self, direction: CopyDirection, pages: int, nbytes: int
    ) -> CopyPath | None:
        """The path this host's timings give the batch, or None where they say
        nothing yet: the caller's own choice stands (kernels, or copy engines
        while another context computes: contention.Contention)."""
        if not timed(pages, nbytes):
            return None
        with self._lock:
            cls = self._classes.get(self._key(direction, pages, nbytes))
            if cls is None or cls.samples["kernel"] < self.samples:
                return None  # kernels first: the table's choice, timed
            winner = cls.winner(self.samples, self.margin)
            loser: CopyPath = "kernel" if winner == "dma" else "dma"
            settled = cls.settled(self.samples)
            if settled:
                gap = self.reprobe_s
            else:  # timed probes once back-to-back ones failed to settle it
                gap = 0.0 if cls.probes < FAST_PROBES else self.probe_s
            now = self._clock()
            if now - cls.last_probe >= gap:
                probe: CopyPath = loser
                if not settled:  # the path with fewer samples
                    probe = min(PATHS, key=lambda p: (cls.samples[p], p != "dma"))
                cls.last_probe = now
                cls.probes += 1
                self.probes[probe] += 1
                return probe
            return "dma" if winner == "dma" else None

    def observe(
        self,
        direction: CopyDirection,
        path: CopyPath,
        pages: int,
        nbytes: int,
        seconds: float,
    ) -> None:
        """A batch that ran alone on its stream took `seconds`."""
        if seconds <= 0 or not timed(pages, nbytes):
            return
        with self._lock:
            cls = self._classes.setdefault(
                self._key(direction, pages, nbytes), SizeClass()
            )
            cls.best[path] = max(cls.best[path], nbytes / seconds)
            cls.samples[path] += 1

    def report(self) -> dict[str, object]:
        """Per class: each path's best GB/s and samples, and the winner."""
        with self._lock:
            rows = [
                {
                    "direction": direction,
                    "page_bytes_log2": page_class - 1,
                    "batch_bytes_log2": batch_class - 1,
                    "kernel_gbps": round(cls.best["kernel"] / 1e9, 2),
                    "dma_gbps": round(cls.best["dma"] / 1e9, 2),
                    "kernel_samples": cls.samples["kernel"],
                    "dma_samples": cls.samples["dma"],
                    "winner": cls.winner(self.samples, self.margin),
                }
                for (direction, page_class, batch_class), cls in sorted(
                    self._classes.items()
                )
            ]
            return {
                "race_probes": dict(self.probes),
                "classes_on_dma": sum(r["winner"] == "dma" for r in rows),
                "classes": rows,
            }
