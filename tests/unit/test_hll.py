"""HyperLogLog: accuracy against exact counts, hash bits, rolling windows."""

from __future__ import annotations

import secrets
import tracemalloc

import numpy as np
import pytest

from pegaflow.cache import hll
from pegaflow.common.hash64 import hash64
from pegaflow.common.settings import HitRateConfig


def _count(h64: np.ndarray, bits: int) -> float:
    registers = np.zeros(1 << bits, np.uint8)
    hll.update(registers, *hll.index_rank(h64, bits))
    return hll.estimate(registers)


def _random(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, n, np.uint64)


def test_error_on_10m_hashes_within_1_percent() -> None:
    """10M random 64-bit hashes, each twice: at the default 16 bits the estimate
    is within 1 % of the exact distinct count (standard error 0.41 %)."""
    h = _random(10_000_000, seed=0)
    ordered = np.sort(h)  # np.unique is 25x slower here (numpy 2.3)
    exact = 1 + int(np.count_nonzero(ordered[1:] != ordered[:-1]))
    bits = HitRateConfig().bucket_bits
    registers = np.zeros(1 << bits, np.uint8)
    for part in np.array_split(np.concatenate([h, h[::-1]]), 8):  # batches, repeats
        hll.update(registers, *hll.index_rank(part, bits))
    assert abs(hll.estimate(registers) / exact - 1) <= 0.01


@pytest.mark.parametrize("n", [0, 1, 10, 300, 5_000, 50_000, 300_000])
def test_estimator_unbiased_from_empty_to_large(n: int) -> None:
    # Ertl's estimator has no switch-over bump between small and large counts:
    # 4 standard errors of 1.04 / 2**6 at 12 bits, and exact for tiny counts.
    est = _count(_random(n, seed=n), bits=12)
    assert abs(est - n) <= max(1.0, 4 * 0.0163 * n)


def test_hash64_takes_the_first_eight_bytes() -> None:
    hashes = [secrets.token_bytes(32) for _ in range(100)]
    want = [int.from_bytes(h[:8], "little") for h in hashes]
    assert hash64(hashes).tolist() == want
    assert hash64(hashes, hash_len=32).tolist() == want
    mixed = [secrets.token_bytes(8 + i % 9) for i in range(50)]
    assert hash64(mixed).tolist() == [int.from_bytes(h[:8], "little") for h in mixed]


def test_short_hashes_stay_distinct_and_spread() -> None:
    """Hashes under 8 bytes lack the bits for index and rank: a bijective mix
    spreads them, so 65536 distinct 2-byte hashes still count as 65536."""
    short = [i.to_bytes(2, "big") for i in range(1 << 16)]
    h = hash64(short)
    assert len(np.unique(h)) == len(short)
    assert abs(_count(h, bits=14) / len(short) - 1) < 0.03
    assert hash64([b"\x01", b"\x01\x00"]).tolist()[0] != hash64([b"\x01\x00"])[0]


def test_window_rolls_over_under_a_fake_clock() -> None:
    """A 150 s window of 15 sub-windows of 10 s: blocks leave it a whole span
    after the sub-window they arrived in began."""
    win = hll.RollingWindow(150.0, bits=12)
    a, b = _random(2000, seed=1), _random(1000, seed=2)
    idx_a, rank_a = hll.index_rank(a, 12)
    win.add(idx_a, rank_a, hits=0, now=3.0)  # sub-window [0, 10)
    win.add(idx_a, rank_a, hits=2000, now=9.0)  # same blocks again: all repeats
    win.add(*hll.index_rank(b, 12), hits=0, now=75.0)  # sub-window [70, 80)
    s = win.stats(now=149.9)
    assert (s.requests, s.hits) == (5000, 2000)
    assert abs(s.unique - 3000) < 0.05 * 3000
    assert abs(s.ceiling - 0.4) < 0.02 and s.hit_rate == 0.4
    s = win.stats(now=150.0)  # [0, 10) has left the window
    assert (s.requests, s.hits) == (1000, 0) and abs(s.unique - 1000) < 50
    # The slot [0, 10) used is reused (and cleared) by [150, 160).
    win.add(*hll.index_rank(b[:10], 12), hits=10, now=151.0)
    s = win.stats(now=152.0)
    assert (s.requests, s.hits) == (1010, 10) and abs(s.unique - 1000) < 50
    assert win.stats(now=300.0).requests == 0  # [150, 160) left at 300
    assert win.stats(now=300.0).ceiling == 0.0


def test_memory_per_window_under_1_mib() -> None:
    """A 24 h window at the default (and maximum) 16 bits, measured by
    tracemalloc (numpy reports its buffers to it)."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    win = hll.RollingWindow(86400.0, bits=HitRateConfig().bucket_bits)
    allocated = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert win.nbytes <= allocated <= 1 << 20
    assert win.nbytes >= hll.SUB_WINDOWS * (1 << 16)


def test_window_config_is_validated() -> None:
    cfg = HitRateConfig.parse("15m,1h,1d", 14)
    assert cfg.windows_s == (900.0, 3600.0, 86400.0)
    assert cfg.labels == ("15m", "1h", "1d")
    for windows, bits in (("15m,900s", 14), ("0.5s", 14), ("1h", 17), ("1h", 3)):
        with pytest.raises(ValueError, match="metric_hll"):
            HitRateConfig.parse(windows, bits)
    for bad in ("15 minutes", "0s", "-1h", "h"):
        with pytest.raises(ValueError, match="duration"):
            HitRateConfig.parse(bad, 14)


def test_window_stats_are_kept_until_a_batch_or_a_sub_window_changes() -> None:
    """A scrape asks every namespace's windows on the event loop (~0.3 ms a
    window to merge and estimate): an idle namespace's answer is kept, and
    the kept one always equals a recomputation, under random batches and
    times."""
    rng = np.random.default_rng(5)
    win = hll.RollingWindow(150.0, bits=10)
    now = 0.0
    for _ in range(400):
        now += float(rng.choice([0.0, 0.5, 3.0, 11.0, 40.0]))
        if rng.random() < 0.4:
            h = _random(int(rng.integers(1, 300)), seed=int(rng.integers(1 << 30)))
            if rng.random() < 0.5:
                win.add(*hll.index_rank(h, 10), hits=int(rng.integers(0, 5)), now=now)
            else:
                batch = np.zeros(1 << 10, np.uint8)
                hll.update(batch, *hll.index_rank(h, 10))
                win.merge(batch, len(h), 1, now)
        got = win.stats(now)
        win._memo = None  # what a recomputation says at the same state
        assert win.stats(now) == got
    h = _random(500, seed=9)
    win.add(*hll.index_rank(h, 10), hits=0, now=now)
    first = win.stats(now + 1.0)
    assert win.stats(now + 1.0) is first  # idle since: kept, not recomputed
    win.add(*hll.index_rank(h[:10], 10), hits=10, now=now + 1.0)
    assert win.stats(now + 1.0).requests == first.requests + 10  # a batch: anew
    assert win.stats(now + 150.0 + 20.0).requests == 0  # aged out


def test_a_kept_merge_is_raised_by_new_batches_and_dropped_with_its_epochs() -> None:
    """Between scrapes an active namespace's batches land in the current
    sub-window: stats() raises the kept merge by that sub-window alone
    (cheaper than merging all fifteen and recounting) and answers what a
    recomputation would. A sub-window reused for a new epoch as its old one
    leaves keeps the same live mask: the kept merge must go then, since the
    reused sub-window's registers were cleared (a mask-only check missed it)."""
    win = hll.RollingWindow(150.0, bits=10)  # 10 s sub-windows
    win.add(*hll.index_rank(_random(3000, seed=1), 10), hits=0, now=5.0)
    win.add(*hll.index_rank(_random(3000, seed=2), 10), hits=0, now=15.0)
    win.stats(16.0)
    kept = win._memo
    win.add(*hll.index_rank(_random(200, seed=3), 10), hits=1, now=17.0)
    got = win.stats(18.0)
    assert win._memo is kept  # raised in place
    win._memo = None
    assert win.stats(18.0) == got
    # [0, 10) ages out as its slot is reused for [150, 160): live are the
    # same two slots as at t=18, one of them now of another epoch.
    kept = win._memo
    assert kept is not None
    win.add(*hll.index_rank(_random(20, seed=4), 10), hits=0, now=151.0)
    got = win.stats(151.0)
    assert win._memo is not kept
    win._memo = None
    assert win.stats(151.0) == got
    assert got.requests == 3000 + 200 + 20
