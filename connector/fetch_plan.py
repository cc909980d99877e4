"""Fetch or recompute: how much of a hit is worth loading.

A block is worth loading when its bytes arrive before this engine would have
computed its tokens. The server tells its recent rates with each query answer
(its copies from L1 into engines and, while a slower tier pulls blocks into
L1, that tier's); the workers time this engine's prefill steps
(forward_timer.py). So per query answer of a part:

- ready (in L1): load the hit when `n * bytes / l1` < `n * tokens / prefill`,
  else recompute all of it (on today's hosts L1 always wins; a slow host copy
  beside a fast GPU would not);
- loading (a tier is pulling n blocks in behind `ready` L1 blocks): wait for
  them when `n * bytes / tier + n * bytes / l1` < `n * tokens / prefill`, else
  take the L1 blocks now and recompute the rest. A wait that lasts twice its
  prediction (at most as long as computing the pulled blocks would take) is
  given up then: with truthful rates a request is never slower than its
  recompute, and a tier slower than it claimed costs at most that wait (its
  rate then drops: the server measures every pull).

The rates are claims: each is clamped to [MIN_GBPS, MAX_GBPS]; with any of
them unknown (0) the hit loads, as with `fetch_planner: off`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MIN_GBPS = 1e-3
MAX_GBPS = 1e4
# Prefill timings past this weight are history (tokens, an exponential mean).
HALF_TOKENS = 8192
# A wait lasting this many times its prediction is given up (never longer
# than computing the blocks would take).
LATE_FACTOR = 2.0

Decision = Literal["load", "recompute"]


@dataclass(frozen=True, slots=True)
class Estimate:
    decision: Decision
    load_s: float  # predicted, for the blocks in question (0 when unknown)
    compute_s: float


def clamp_gbps(value: float) -> float:
    """A server's rate claim, bounded; 0.0 for unknown or nonsense."""
    if not math.isfinite(value) or value <= 0:
        return 0.0
    return min(max(value, MIN_GBPS), MAX_GBPS)


class FetchPlanner:
    def __init__(self, enabled: bool = True, max_wait_s: float = 10.0) -> None:
        """max_wait_s: the longest a request waits for a tier's pull that no
        rate prices (a server that answers `loading` for good would hold it
        for good); a priced one waits no longer than computing would take."""
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._tokens_per_s = 0.0
        # request -> when waiting for its pulled blocks stops paying off
        self._give_up_at: dict[str, float] = {}

    # -- this engine's prefill rate -------------------------------------------
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        rate = tokens / seconds
        keep = 0.5 ** (tokens / HALF_TOKENS)
        past = self._tokens_per_s or rate
        self._tokens_per_s = keep * past + (1 - keep) * rate

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tokens_per_s

    # -- decisions --------------------------------------------------------------
    def ready(
        self, blocks: int, block_bytes: int, block_tokens: int, l1_gbps: float
    ) -> Estimate:
        """An L1 hit of `blocks`: load it, or recompute it?"""
        l1 = clamp_gbps(l1_gbps)
        compute = self._compute_s(blocks * block_tokens)
        if not (self.enabled and l1 and compute and block_bytes and blocks):
            return Estimate("load", 0.0, compute)
        load = blocks * block_bytes / (l1 * 1e9)
        return Estimate("load" if load < compute else "recompute", load, compute)

    def pulling(
        self,
        request_id: str,
        now: float,
        blocks: int,
        block_bytes: int,
        block_tokens: int,
        tier_gbps: float,
        l1_gbps: float,
    ) -> Estimate:
        """A tier pulls `blocks` into L1 for this request: wait (load), or take
        what L1 holds now (recompute the pulled ones)?"""
        compute = self._compute_s(blocks * block_tokens)
        tier, l1 = clamp_gbps(tier_gbps), clamp_gbps(l1_gbps)
        if not (self.enabled and tier and l1 and compute and block_bytes and blocks):
            give_up = self._give_up_at.setdefault(request_id, now + self.max_wait_s)
            decision: Decision = "recompute" if now >= give_up else "load"
            return Estimate(decision, 0.0, compute)
        load = blocks * block_bytes / (tier * 1e9) + blocks * block_bytes / (l1 * 1e9)
        if load >= compute:
            self._give_up_at.pop(request_id, None)
            return Estimate("recompute", load, compute)
        patience = min(compute, max(LATE_FACTOR * load, compute / 10))
        give_up = self._give_up_at.setdefault(request_id, now + patience)
        if now >= give_up:  # slower than its rate said: computing is sooner now
            return Estimate("recompute", load, compute)
        return Estimate("load", load, compute)

    def forget(self, request_id: str) -> None:
        """The request's wait ended (its blocks came, it left, or gave up)."""
        self._give_up_at.pop(request_id, None)

    def _compute_s(self, tokens: int) -> float:
        rate = self._tokens_per_s
        return tokens / rate if rate else 0.0
