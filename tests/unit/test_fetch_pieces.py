"""A fetch's read in pieces submitted at once (pegaflow.tiers.remote.fetch): every
slot hashed from the bytes that landed in it, in order; when a piece fails,
every piece is waited out, and the read's error says whether bytes may still
land (then its slots are quarantined, never reused at once)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash
from prometheus_client import CollectorRegistry

from pegaflow.cache.pool import HostPool, PoolConfig
from pegaflow.tiers.remote import fetch
from pegaflow.tiers.remote.fetch import OwnerReads, RemoteStats
from pegaflow.tiers.remote.remote_metrics import RemoteMetrics
from pegaflow.tiers.remote.slot_sums import SlotHasher
from pegaflow.tiers.remote.transfer_engine import TransportError

SLOT = 4096


class PieceTransport:
    """Each submitted piece lands (random bytes into its local slots) when
    its wait is called; the piece `fail_at` fails there instead."""

    def __init__(
        self, pool: HostPool, fail_at: int = -1, error: BaseException | None = None
    ) -> None:
        self.pool, self.fail_at = pool, fail_at
        self.error = error or TransportError("piece failed")
        self.pieces: list[dict] = []
        self.retried = 0
        self.rng = np.random.default_rng(5)

    def submit(self, endpoint, local, remote, lengths):
        piece = {"local": local.copy(), "waited": False, "retry": None}
        index = len(self.pieces)
        self.pieces.append(piece)

        def wait(retry: bool = True) -> None:
            piece["waited"], piece["retry"] = True, retry
            if index == self.fail_at:
                raise self.error
            for address in piece["local"].tolist():
                self.pool.view(address, SLOT)[:] = self.rng.integers(0, 256, SLOT)

        return wait


@pytest.fixture
def pool():
    p = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    yield p
    p.close()


def reads(pool: HostPool, transport: PieceTransport, hasher: SlotHasher) -> OwnerReads:
    metrics = RemoteMetrics(CollectorRegistry())
    return OwnerReads(None, transport, pool, metrics, RemoteStats(), "n", None, set(),
                      hasher)  # fmt: skip


def slots(pool: HostPool, blocks: int, shards: int) -> np.ndarray:
    picked = np.random.default_rng(1).choice(pool.size // SLOT, blocks * shards, False)
    return (pool.base + picked * SLOT).astype(np.uint64).reshape(blocks, shards)


def test_every_slot_hashed_from_what_landed(pool, monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_PIECE_BYTES", 3 * 2 * SLOT)  # 3 blocks a piece
    transport, hasher = PieceTransport(pool), SlotHasher(3, min_share_bytes=SLOT)
    local = slots(pool, 20, 2)
    try:
        sums = reads(pool, transport, hasher)._read_and_hash(
            "peer", local, local, SLOT, {}
        )
    finally:
        hasher.close()
    assert len(transport.pieces) == 7  # 20 blocks, 3 a piece
    want = [xxhash.xxh3_64_intdigest(pool.view(int(a), SLOT)) for a in local.ravel()]
    assert sums.shape == (20, 2)
    assert sums.ravel().tolist() == want


def test_a_failed_piece_waits_for_the_others(pool, monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_PIECE_BYTES", 2 * SLOT)  # one block a piece
    transport, hasher = PieceTransport(pool, fail_at=1), SlotHasher(1)
    try:
        with pytest.raises(TransportError, match="piece failed"):
            reads(pool, transport, hasher)._read_and_hash(
                "peer", slots(pool, 5, 2), slots(pool, 5, 2), SLOT, {}
            )
    finally:
        hasher.close()
    assert [p["waited"] for p in transport.pieces] == [True] * 5
    # Once one failed, the rest are waited out without a retry each.
    assert [p["retry"] for p in transport.pieces] == [True, True, False, False, False]


@pytest.mark.parametrize(
    "error, in_flight",
    [
        (TransportError("refused"), False),
        (TransportError("failed", in_flight=True), True),
        (ValueError("the engine said something unexpected"), True),
    ],
)
def test_a_failed_read_says_whether_bytes_may_still_land(
    pool, monkeypatch, error, in_flight
) -> None:
    monkeypatch.setattr(fetch, "_PIECE_BYTES", 2 * SLOT)  # one block a piece
    transport, hasher = PieceTransport(pool, fail_at=2, error=error), SlotHasher(1)
    try:
        with pytest.raises(TransportError) as err:
            reads(pool, transport, hasher)._read_and_hash(
                "peer", slots(pool, 5, 2), slots(pool, 5, 2), SLOT, {}
            )
    finally:
        hasher.close()
    assert err.value.in_flight is in_flight
    assert all(p["waited"] for p in transport.pieces)
