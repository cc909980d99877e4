"""The mapped-flag completion wait (pegaflow.copiers.completion.StreamFlag),
over a stand-in stream: a thread that runs queued writes in order."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from types import SimpleNamespace

import numpy as np

from pegaflow.common.geometry import Transfers
from pegaflow.copiers.completion import MASK, StreamFlag, reached


class FakeStream:
    """Runs each queued (address, value) write after `delay_s`, in order."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.queued: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self.written: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def write(self, stream: int, address: int, value: int) -> None:
        assert stream == 7
        self.queued.put((address, value))

    def _run(self) -> None:
        while (item := self.queued.get()) is not None:
            time.sleep(self.delay_s)
            address, value = item
            ctypes.c_uint32.from_address(address).value = value
            self.written.append(value)

    def stop(self) -> None:
        self.queued.put(None)
        self.thread.join(5)


def _word() -> tuple[np.ndarray, int]:
    mem = np.zeros(2, np.uint32)
    return mem, mem.ctypes.data  # host and "device" address are one here


def test_reached_wraps_around() -> None:
    assert reached(5, 5) and reached(6, 5) and not reached(4, 5)
    assert reached(1, MASK) and not reached(MASK, 1)  # 2**32 - 1, then 0, 1


def test_a_wait_ends_once_the_stream_wrote_its_number() -> None:
    mem, address = _word()
    stream = FakeStream(delay_s=1e-3)
    flag = StreamFlag(address, address, stream.write, spin_s=5.0)  # a busy CI host
    synced: list[int] = []
    try:
        for _ in range(3):
            assert flag.wait(7, lambda: synced.append(1))
    finally:
        stream.stop()
    assert stream.written == [1, 2, 3] and int(mem[0]) == 3 and not synced


def test_a_stream_that_never_writes_falls_back_to_the_synchronize() -> None:
    """Scenario: the copy faulted, so the stream never runs the flag's write;
    the wait ends in the synchronize (where the fault would be raised)."""
    mem, address = _word()
    queued: list[int] = []
    flag = StreamFlag(address, address, lambda s, a, v: queued.append(v), 5e-3)
    synced: list[int] = []
    start = time.perf_counter()
    assert not flag.wait(7, lambda: synced.append(1))
    assert synced == [1] and queued == [1] and time.perf_counter() - start >= 5e-3


def test_threads_sharing_a_stream_each_wait_for_their_own_number() -> None:
    """Scenario: 4 copy threads issue on one stream at once; numbers are taken
    in queue order, so the word only grows and no waiter misses its own."""
    _, address = _word()
    stream = FakeStream(delay_s=1e-4)
    flag = StreamFlag(address, address, stream.write, spin_s=5.0)
    results: list[bool] = []

    def worker() -> None:
        for _ in range(25):
            results.append(flag.wait(7, lambda: results.append(False)))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stream.stop()
    assert results == [True] * 100
    assert stream.written == list(range(1, 101))


class _Kernels:
    def __init__(self) -> None:
        self.synced: list[object] = []

    def synchronize(self, stream: object) -> None:
        self.synced.append(stream)


class _Stream:
    handle = 7


def test_the_cuda_copier_waits_by_flag_for_small_dma_batches_only() -> None:
    """CudaCopyEngine._finish: a copy-engine batch up to FLAG_MAX_BYTES ends
    with the flag; a kernel batch, a larger one, or a device without flags
    with the stream synchronize (COMPLETION)."""
    from pegaflow.copiers import cuda_copier as cuda
    from pegaflow.copiers.measured import FLAG_MAX_BYTES

    _, address = _word()
    stream = FakeStream()
    flag = StreamFlag(address, address, stream.write, spin_s=5.0)
    save, load = _Stream(), _Stream()
    dev = cuda._Device(0, b"u", None, save, load, {"save": flag})
    engine = object.__new__(cuda.CudaCopyEngine)
    engine._k = _Kernels()  # type: ignore[attr-defined]

    def batch(nbytes: int) -> Transfers:
        one = np.array([1 << 20], np.uint64)
        return Transfers(one, one, np.array([nbytes], np.uint64))

    try:
        engine._finish(dev, "save", "dma", batch(FLAG_MAX_BYTES))
        assert stream.thread.is_alive() and engine._k.synced == []
        engine._finish(dev, "save", "kernel", batch(1 << 20))
        engine._finish(dev, "save", "dma", batch(FLAG_MAX_BYTES + 1))
        engine._finish(dev, "load", "dma", batch(1 << 20))  # no load flag here
    finally:
        stream.stop()
    assert engine._k.synced == [save, save, load] and stream.written == [1]


def test_the_first_reads_of_a_wait_make_no_syscall(monkeypatch) -> None:
    """A 1-block batch ends ~35 us after it is queued (the H200); each
    sleep(0) between reads slept the kernel's 50 us timer slack (a save's
    flag wait 70 us P50, 49 of them asleep). So for HOT_S the word is read
    without a sleep; after that the reads yield the GIL again. A fake clock
    that advances 5 us per read, and a "GPU" that writes the word at a given
    time, make the test exact."""
    from pegaflow.copiers import completion

    mem, address = _word()
    now = [0.0]
    lands_at = [0.0]
    sleeps: list[float] = []

    def clock() -> float:
        now[0] += 5e-6
        if now[0] >= lands_at[0]:
            mem[0] = flag._seq  # the stream's write, needing no GIL
        return now[0]

    # The module's own clock and sleep only: other threads keep the real ones.
    fake = SimpleNamespace(perf_counter=clock, sleep=sleeps.append)
    monkeypatch.setattr(completion, "time", fake)
    flag = StreamFlag(address, address, lambda s, a, v: None, spin_s=5e-3)
    for landing_after, slept in ((40e-6, False), (3 * completion.HOT_S, True)):
        lands_at[0] = now[0] + landing_after
        sleeps.clear()
        assert flag.wait(7, lambda: None)
        assert bool(sleeps) == slept, (landing_after, len(sleeps))
