"""This engine's prefill rate, timed by the worker from its own forward steps:
what the fetch-or-recompute planner (fetch_plan.py) weighs a load against.

A step is timed from start_load_kv to wait_for_save, when it computes at least
MIN_STEP_TOKENS tokens and waits for no sync load (a load is not compute). On
a GPU those calls return once the kernels are queued, so two CUDA events on
the compute stream time it instead, read a step or more later once the second
has completed (never a host sync). Decode-only steps are skipped: their cost
per token says nothing about a prefill's.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

MIN_STEP_TOKENS = 64
MAX_PENDING = 8  # GPU timings not read yet; more are dropped, not waited for


class ForwardTimer:
    def __init__(self, device: str = "cpu") -> None:
        self._device = device
        self._started: tuple[object, int, Any] | None = None  # plan, tokens, mark
        self._pending: deque[tuple[int, Any, Any]] = deque()
        self.tokens = 0
        self.seconds = 0.0

    def start(self, plan: object, tokens: int) -> None:
        self._started = None
        if tokens >= MIN_STEP_TOKENS:
            self._started = (plan, tokens, self._mark())

    def stop(self, plan: object) -> None:
        """The step's forward was issued; a start for another plan (or none)
        times nothing."""
        started, self._started = self._started, None
        if started is None or started[0] is not plan:
            return
        _, tokens, begin = started
        if self._device == "cpu":
            self.tokens += tokens
            self.seconds += time.perf_counter() - begin
        elif len(self._pending) < MAX_PENDING:
            self._pending.append((tokens, begin, self._mark()))

    def take(self) -> tuple[int, float]:
        """(tokens, seconds) timed since the last take."""
        while self._pending and self._pending[0][2].query():
            tokens, begin, end = self._pending.popleft()
            self.tokens += tokens
            self.seconds += begin.elapsed_time(end) / 1e3
        got = (self.tokens, self.seconds)
        self.tokens, self.seconds = 0, 0.0
        return got

    def _mark(self) -> Any:
        if self._device == "cpu":
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(torch.device(self._device)))
        return event
