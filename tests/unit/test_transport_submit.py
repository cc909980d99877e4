"""MooncakeTransport.submit over a stand-in for Mooncake's engine: every
submitted batch is waited for, a failed one is read again once (not with
retry=False), and a submission that raises leaves nothing in flight."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.remote import transport as tr
from pegaflow.remote.transport import MooncakeTransport, TransportError


class Engine:
    def __init__(self, status: int = 0, sync: int = 0, raise_at: int = -1) -> None:
        self.status, self.sync, self.raise_at = status, sync, raise_at
        self.submitted: list[int] = []
        self.waited: list[int] = []
        self.sync_reads = 0

    def batch_transfer_async_read(self, endpoint, local, remote, lengths) -> int:
        if len(self.submitted) == self.raise_at:
            raise TypeError("bad arguments")
        self.submitted.append(len(local))
        return len(self.submitted)  # a batch id, never 0

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


def test_a_failed_batch_is_read_again_once() -> None:
    engine = Engine(status=-1)
    t = transport(engine)
    t.submit("peer:1", *arrays(4))()
    assert engine.waited == [1] and engine.sync_reads == 1 and t.retried == 1


def test_without_retry_a_failure_raises_at_once() -> None:
    engine = Engine(status=-1)
    with pytest.raises(TransportError):
        transport(engine).submit("peer:1", *arrays(4))(retry=False)
    assert engine.waited == [1] and engine.sync_reads == 0


def test_a_retry_that_fails_raises() -> None:
    with pytest.raises(TransportError, match="peer:1"):
        transport(Engine(status=-1, sync=-1)).submit("peer:1", *arrays(4))()


def test_a_submission_that_raises_waits_for_the_batches_before(monkeypatch) -> None:
    monkeypatch.setattr(tr, "MAX_BATCH_BYTES", 2 << 20)  # two entries a batch
    engine = Engine(raise_at=1)
    with pytest.raises(TypeError):
        transport(engine).submit("peer:1", *arrays(6))
    assert engine.submitted == [2] and engine.waited == [1]
