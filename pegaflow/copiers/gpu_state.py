"""What the CUDA copier (pegaflow.copiers.cuda_copier) knows about its GPUs between
copies: the batches in flight on each stream, the GPU time per byte of recent
batches, and the faults that broke a GPU's context. Pure Python: tested
without a GPU (tests/unit/test_cuda_copy_errors.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Hashable, Iterator

from pegaflow.common import cuda_driver
from pegaflow.common.errors import DeviceBroken

logger = logging.getLogger(__name__)

RATE_MIN_BYTES = 1 << 20  # batches this large teach the rate estimate
RATE_ALPHA = 0.5  # weight of the newest batch's rate


class InFlight:
    """Batches queued and not yet waited for, per stream key (device,
    direction). Thread-safe: copy threads and the event loop both count."""

    def __init__(self) -> None:
        self._counts: dict[Hashable, int] = {}
        self._lock = threading.Lock()

    def add(self, key: Hashable, step: int) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + step

    def busy(self, key: Hashable) -> bool:
        """Whether a copy started now on the event loop could wait there: its
        stream has a batch in flight (a sync would wait for that one too).
        Other streams' batches do not count: the kernels lock launches per
        stream. (A rule "or any stream two" dated from one launch lock for all
        streams; an H200 A/B without it, 2026-12-04, was no slower in any row
        and faster both ways at once: benchmarks/RESULTS.md, "eleventh
        session".)"""
        with self._lock:
            return self._busy(key)

    def claim(self, key: Hashable) -> bool:
        """Count one batch on `key` unless busy(key): check and count at once."""
        with self._lock:
            if self._busy(key):
                return False
            self._counts[key] = 1
            return True

    def counts(self) -> dict[Hashable, int]:
        with self._lock:
            return dict(self._counts)

    def _busy(self, key: Hashable) -> bool:
        return bool(self._counts.get(key))


class Rates:
    """Bytes per second of GPU time per (device, direction, path) and size
    class (log2 of a batch's bytes): a 640-block batch is not timed by
    64-block ones (kernels speed up with size: an estimate from smaller ones
    made the loop wake ~2 ms late, H200, sixth session)."""

    def __init__(self) -> None:
        self._by_key: dict[Hashable, dict[int, float]] = {}

    def learn(self, key: Hashable, nbytes: int, seconds: float) -> None:
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        rates = self._by_key.setdefault(key, {})
        rate, size = nbytes / seconds, nbytes.bit_length()
        old = rates.get(size)
        rates[size] = (
            rate if old is None else RATE_ALPHA * rate + (1 - RATE_ALPHA) * old
        )

    def rate(self, key: Hashable, nbytes: int) -> float | None:
        """The batch's size class's recent rate, else the fastest class's (an
        early wake only polls longer); None before any batch was timed."""
        rates = self._by_key.get(key)
        if not rates:
            return None
        return rates.get(nbytes.bit_length()) or max(rates.values())

    def by_size(self, key: Hashable) -> dict[int, float]:
        return dict(self._by_key.get(key, {}))


class Faults:
    """GPUs whose CUDA context a sticky fault broke (cuda_driver.STICKY):
    every later call there fails the same way until the process exits."""

    def __init__(self) -> None:
        self.reasons: dict[int, str] = {}  # GPU ordinal -> the fault

    def check(self, ordinal: int) -> None:
        """Refuse at once on a broken GPU."""
        fault = self.reasons.get(ordinal)
        if fault is not None:
            raise DeviceBroken(
                f"device {ordinal}: its CUDA context is broken since {fault}; "
                "every copy on it fails until the server restarts (with "
                "--pool-file its cache survives the restart)"
            )

    def note(self, ordinal: int, exc: BaseException) -> None:
        if cuda_driver.sticky_error(exc) is None or ordinal in self.reasons:
            return
        self.reasons[ordinal] = str(exc)[:200]
        logger.error(
            "GPU %d: CUDA context broken (%s); its copies fail from now on and "
            "/health says degraded: restart the server",
            ordinal,
            exc,
        )

    @contextlib.contextmanager
    def noted(self, ordinal: int) -> Iterator[None]:
        """Note a sticky fault an exception of the block names, and re-raise."""
        try:
            yield
        except BaseException as exc:
            self.note(ordinal, exc)
            raise
