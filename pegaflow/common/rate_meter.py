"""A tier's recent transfer rate, told to engines with each query answer so
their connector can decide whether loading a hit beats recomputing it.

An exponentially weighted mean of GB/s over recent transfers, each weighted
by its bytes (a 1-block load says little about a 640-block one). Transfers
too small to time say nothing and are skipped. Unknown until the first
transfer: the connector then loads, as it would without a planner.
"""

from __future__ import annotations

import math
import threading

# A transfer shorter than this is mostly call overhead, not bandwidth.
MIN_SECONDS = 50e-6
# The weight the mean gives its past after one more transfer of HALF_BYTES.
HALF_BYTES = 64 << 20


class RateMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # copy threads and the event loop observe
        self._gbps = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not seconds >= MIN_SECONDS or math.isinf(seconds):
            return
        rate = nbytes / seconds / 1e9
        keep = 0.5 ** (nbytes / HALF_BYTES)
        with self._lock:
            self._gbps = (
                rate if not self._gbps else keep * self._gbps + (1 - keep) * rate
            )

    @property
    def gbps(self) -> float:
        """The recent rate, 0.0 while unknown."""
        return self._gbps
