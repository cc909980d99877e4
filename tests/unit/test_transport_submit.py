"""MooncakeTransport.submit over a stand-in for Mooncake's engine: every
submitted batch is waited for; a batch that failed once submitted is never
read again into the same addresses (its other tasks may still write them: the
error says so), while one refused at submission, with nothing in flight, is
read again once; a submission that raises waits for the batches before it."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.tiers.remote import transfer_engine as tr
from pegaflow.tiers.remote.transfer_engine import MooncakeTransport, TransportError


class Engine:
    def __init__(
        self, status: int = 0, sync: int = 0, raise_at: int = -1, refuse: bool = False
    ) -> None:
        self.status, self.sync, self.raise_at = status, sync, raise_at
        self.refuse = refuse  # every submission answered 0, Mooncake's refusal
        self.submitted: list[int] = []
        self.waited: list[int] = []
        self.sync_reads = 0

    def batch_transfer_async_read(self, endpoint, local, remote, lengths) -> int:
        if len(self.submitted) == self.raise_at:
            raise TypeError("bad arguments")
        self.submitted.append(len(local))
        return 0 if self.refuse else len(self.submitted)  # a batch id, never 0

    def get_batch_transfer_status(self, ids) -> int:
        self.waited += ids
        return self.status

    def batch_transfer_sync_read(self, endpoint, local, remote, lengths) -> int:
        self.sync_reads += 1
        return self.sync


def transport(engine: Engine) -> MooncakeTransport:
    t = object.__new__(MooncakeTransport)  # no real engine behind it
    t._engine, t.retried = engine, 0
    return t


def arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.arange(n, dtype=np.uint64),
        np.arange(n, dtype=np.uint64),
        np.full(n, 1 << 20, np.uint64),
    )


@pytest.mark.parametrize("retry", [True, False])
def test_a_batch_failed_after_submission_is_not_read_again(retry) -> None:
    engine = Engine(status=-1)
    with pytest.raises(TransportError) as err:
        transport(engine).submit("peer:1", *arrays(4))(retry=retry)
    assert err.value.in_flight
    assert engine.waited == [1] and engine.sync_reads == 0


def test_a_refused_batch_is_read_again_once() -> None:
    engine = Engine(refuse=True)
    t = transport(engine)
    t.submit("peer:1", *arrays(4))()
    assert engine.waited == [] and engine.sync_reads == 1 and t.retried == 1


def test_a_refused_batch_without_retry_left_nothing_in_flight() -> None:
    engine = Engine(refuse=True)
    with pytest.raises(TransportError) as err:
        transport(engine).submit("peer:1", *arrays(4))(retry=False)
    assert not err.value.in_flight and engine.sync_reads == 0


def test_a_retry_that_fails_may_leave_bytes_in_flight() -> None:
    with pytest.raises(TransportError, match="peer:1") as err:
        transport(Engine(sync=-1, refuse=True)).submit("peer:1", *arrays(4))()
    assert err.value.in_flight


def test_a_submission_that_raises_waits_for_the_batches_before(monkeypatch) -> None:
    monkeypatch.setattr(tr, "MAX_BATCH_BYTES", 2 << 20)  # two entries a batch
    engine = Engine(raise_at=1)
    with pytest.raises(TypeError):
        transport(engine).submit("peer:1", *arrays(6))
    assert engine.submitted == [2] and engine.waited == [1]


def test_a_submission_that_raises_after_a_failed_batch_says_in_flight(
    monkeypatch,
) -> None:
    monkeypatch.setattr(tr, "MAX_BATCH_BYTES", 2 << 20)
    engine = Engine(status=-1, raise_at=1)
    with pytest.raises(TransportError) as err:
        transport(engine).submit("peer:1", *arrays(6))
    assert err.value.in_flight and isinstance(err.value.__cause__, TypeError)


def test_quarantine_outlasts_the_configured_timeouts(monkeypatch) -> None:
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    monkeypatch.delenv("MC_TCP_PROGRESS_TIMEOUT_SEC", raising=False)
    assert tr.quarantine_s() == 60.0
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "30")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "not a number")
    assert tr.quarantine_s() == 120.0
