"""The SSD tier closing while a load is handed to its readers: the load is
read whole before the files close, or fails with SsdClosed; never an error
from the reader pool, a future that never completes, or a read of a closed
file."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pegaflow.gds import SsdTier
from pegaflow.gds import tier as ssd_tier
from tests.gds.helpers import NS, addresses, block, config, key, spill

SLOT = 16384


class _Gate:
    """Stands in for tier._loads_gate; says when the closing thread waits on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closer_waits = threading.Event()

    def __enter__(self) -> _Gate:
        if threading.current_thread().name == "closer":
            self.closer_waits.set()
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


class _Readers:
    """The tier's reader pool; close() begins between a load's two reads."""

    def __init__(self, real: ThreadPoolExecutor, gate: _Gate, closer: Any) -> None:
        self.real, self.gate, self.closer = real, gate, closer
        self.calls = 0
        self.shut = threading.Event()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        self.calls += 1
        if self.calls == 2:
            self.closer.start()
            if self.gate.lock.locked():  # the load holds the gate: close waits
                assert self.gate.closer_waits.wait(30)
            else:  # nothing holds close back: it runs to the end
                assert self.shut.wait(30)
                self.closer.join(30)
        return self.real.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self.shut.set()
        self.real.shutdown(wait=wait)


def _slots(n: int) -> tuple[np.ndarray, np.ndarray]:
    dst = np.zeros((n, 1, SLOT), np.uint8)
    table = np.array([addresses(d) for d in dst], np.uint64).reshape(n, 1)
    return dst, table


def test_load_racing_close_is_read_whole_or_refused(tmp_path: Path) -> None:
    """Regression: load() checked `closed` without a lock, then handed its
    reads to the pool one by one; a close() in between shut the pool, the
    next hand-off raised the pool's RuntimeError out of load() and the
    load's future never completed. Now a load that checked first has all its
    reads queued before close shuts the pool (which waits for them, then
    the files close); one after close fails with SsdClosed."""
    tier = SsdTier(config(tmp_path, read_threads=2))
    try:
        spill(tier, [0, 1], slot_bytes=SLOT)
        closer = threading.Thread(target=tier.close, name="closer")
        gate = _Gate()
        tier._loads_gate = gate  # type: ignore[assignment]
        readers = _Readers(tier._readers, gate, closer)
        tier._readers = readers  # type: ignore[assignment]
        dst, table = _slots(2)
        fut = tier.load(NS, [key(0), key(1)], table, SLOT)
        res = fut.result(timeout=30)
        closer.join(30)
        assert not closer.is_alive() and readers.shut.is_set()
        assert res.ok.all()
        for i in range(2):
            assert np.array_equal(dst[i], block(i, 1, SLOT))
        _, table = _slots(1)
        late = tier.load(NS, [key(0)], table, SLOT)
        with pytest.raises(ssd_tier.SsdClosed, match="closed"):
            late.result(timeout=30)
    finally:
        tier.close()
