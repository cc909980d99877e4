"""The pool pinned chunk by chunk beside a serving server (pegaflow.cache.
pin_chunks): a copy's chunks are pinned next and it waits for them alone, a
failed chunk fails its waiters (never a hang) and stops the rest, a deadline
bounds a wait, and a stop or a pool close mid-pinning unregisters exactly the
chunks that were registered. The registrar is a stand-in: it pins nothing,
records the order, and holds or fails chunks on demand."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pegaflow.cache.pin_chunks import ChunkPins
from pegaflow.cache.pool import HostPool
from pegaflow.cache.pool_file import PoolFileError
from pegaflow.common import cuda_driver
from pegaflow.common.cuda_driver import CudaError
from pegaflow.common.errors import CopyFailed, DeadlineExceeded, DeviceBroken
from pegaflow.common.geometry import Transfers
from pegaflow.common.settings import PoolConfig
from pegaflow.copiers import cuda_copier
from pegaflow.copiers.cuda_copier import CudaCopyEngine
from pegaflow.copiers.gpu_state import Faults, InFlight, Rates
from tests.keeper_tools import free

WAIT_S = 30.0
CHUNK = 1 << 20
BASE = 1 << 40  # nothing is touched at these addresses


class FakeRegistrar:
    """Chunk k of a pool at `base` registers after `delay_s`, or once
    `release(k)` when held; the chunk `fail` raises as CUDA would."""

    def __init__(
        self,
        base: int = BASE,
        threads: int = 1,
        held: tuple[int, ...] = (),
        fail: int | None = None,
        delay_s: float = 0.0,
        chunk_bytes: int = CHUNK,
    ) -> None:
        self.base, self.chunk_bytes, self.threads = base, chunk_bytes, threads
        self.fail, self.delay_s = fail, delay_s
        self.gates = {k: threading.Event() for k in held}
        self.started: list[int] = []
        self.registered: list[int] = []
        self.unregistered: list[int] = []
        self.began = threading.Condition()

    def release(self, k: int) -> None:
        self.gates[k].set()

    def wait_started(self, k: int) -> None:
        with self.began:
            assert self.began.wait_for(lambda: k in self.started, WAIT_S)

    def register_chunk(self, address: int, size: int) -> None:
        k = (address - self.base) // self.chunk_bytes
        with self.began:
            self.started.append(k)
            self.began.notify_all()
        if k in self.gates:
            assert self.gates[k].wait(WAIT_S)
        time.sleep(self.delay_s)
        if k == self.fail:
            raise CudaError("cudaHostRegister: cudaErrorInvalidValue")
        self.registered.append(k)

    def unregister_chunk(self, address: int) -> None:
        self.unregistered.append((address - self.base) // self.chunk_bytes)


def _pins(reg: FakeRegistrar, chunks: int, **kw: object) -> ChunkPins:
    pins = ChunkPins(reg.base, chunks * CHUNK - 4096, reg, **kw)  # a short last one
    pins.start()
    return pins


def _at(k: int) -> np.ndarray:
    """One page-sized slot range inside chunk k."""
    return np.array([BASE + k * CHUNK + 8192], np.uint64)


PAGE = np.array([4096], np.uint64)


def test_ranges_map_to_the_chunks_they_touch() -> None:
    pins = ChunkPins(BASE, 8 * CHUNK, FakeRegistrar())
    addresses = np.array(
        [BASE + 5 * CHUNK, BASE + 2 * CHUNK - 16, BASE + 5 * CHUNK + 64], np.uint64
    )
    nbytes = np.array([64, 32, 64], np.uint64)  # the second straddles 1 | 2
    assert pins.chunks_of(addresses, nbytes).tolist() == [1, 2, 5]
    below = np.array([BASE - 4096], np.uint64)  # wraps; the copy's check refuses it
    assert pins.chunks_of(below, PAGE).tolist() == [7]
    # A range longer than two chunks touches every chunk in between too.
    long = np.array([3 * CHUNK + 8], np.uint64)
    assert pins.chunks_of(np.array([BASE + 8], np.uint64), long).tolist() == [
        0,
        1,
        2,
        3,
    ]


def test_a_copy_s_chunk_is_pinned_next_and_it_waits_for_that_alone() -> None:
    """One pinning thread, busy with chunk 0 and chunk 1 held: a copy of a
    slot in chunk 6 moves 6 before 1..5, and returns once 6 is pinned while
    1 still is not; the rest follow in address order."""
    reg = FakeRegistrar(held=(0, 1))
    pins = _pins(reg, 8)
    reg.wait_started(0)
    chunks = pins.chunks_of(_at(6), PAGE)
    assert not pins.ready(chunks)  # asked from the loop: queued first, no wait
    waited: list[bool] = []
    waiter = threading.Thread(
        target=lambda: waited.append(pins.wait(chunks, None, "load") is None)
    )
    waiter.start()
    time.sleep(0.05)
    assert not waited  # chunk 0 still pinning
    reg.release(0)
    waiter.join(WAIT_S)
    assert waited == [True]
    assert pins.pinned[6] and not pins.pinned[1] and not pins.complete
    assert reg.started[:3] == [0, 6, 1]
    reg.release(1)
    pins.wait_all()
    assert pins.complete and reg.registered == [0, 6, 1, 2, 3, 4, 5, 7]
    assert pins.report()["chunks_pinned"] == 8 and pins.report()["chunks"] == 8
    pins.unpin()
    assert sorted(reg.unregistered) == list(range(8)) and not pins.pinned.any()


def test_a_failed_chunk_fails_its_waiters_and_stops_the_rest() -> None:
    """Chunk 2 refused (asked for while chunk 0 pinned): copies of chunk 0
    go on, those of any other chunk get DeviceBroken naming the cause (as
    `explain` words it), nothing else is registered, and unpin() undoes only
    chunk 0."""
    reg = FakeRegistrar(held=(0,), fail=2)

    def explain(exc: BaseException) -> BaseException:
        return RuntimeError(f"explained: {exc}")

    pins = _pins(reg, 6, explain=explain)
    reg.wait_started(0)
    assert not pins.ready(pins.chunks_of(_at(2), PAGE))
    reg.release(0)
    with pytest.raises(DeviceBroken, match="explained: .*cudaErrorInvalidValue"):
        pins.wait(pins.chunks_of(_at(2), PAGE), None, "save")
    pins.wait(pins.chunks_of(_at(0), PAGE), None, "save")  # pinned before: fine
    with pytest.raises(DeviceBroken, match="pool chunk\\(s\\) 1, 2, 3, 4 \\(\\+1"):
        pins.wait_all()
    assert not pins.ready(pins.chunks_of(_at(4), PAGE))
    assert pins.pinned.tolist() == [True, False, False, False, False, False]
    assert reg.started == [0, 2] and not pins.complete
    assert "explained" in str(pins.report()["failed"])
    pins.unpin()
    assert reg.unregistered == [0]


def test_the_deadline_bounds_a_wait() -> None:
    """A copy whose deadline passes while its chunk is still being pinned
    fails with DeadlineExceeded saying nothing was copied, on time."""
    reg = FakeRegistrar(held=(0,))
    pins = _pins(reg, 2)
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="nothing was copied"):
        pins.wait(pins.chunks_of(_at(0), PAGE), start + 0.05, "load")
    assert time.monotonic() - start < 2.0
    reg.release(0)
    pins.wait_all()
    pins.unpin()


def test_a_stop_drops_queued_chunks_and_fails_their_waiters() -> None:
    """stop() lets the chunk being pinned finish, pins nothing more, and a
    copy waiting for a dropped chunk fails at once (never a hang)."""
    reg = FakeRegistrar(held=(0,))
    pins = _pins(reg, 4)
    reg.wait_started(0)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            pins.wait(pins.chunks_of(_at(3), PAGE), None, "load")
        except CopyFailed as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    stopper = threading.Thread(target=pins.stop)
    stopper.start()
    waiter.join(WAIT_S)
    assert failed and "stopping" in str(failed[0])
    assert stopper.is_alive()  # chunk 0 is still being registered
    reg.release(0)
    stopper.join(WAIT_S)
    pins.unpin()
    assert reg.registered == [0] and reg.unregistered == [0]


def test_a_pool_closed_while_pinning_unregisters_what_was_registered() -> None:
    """HostPool.close() mid-pinning waits for the chunk being registered,
    pins no more, and unregisters exactly the chunks that were."""
    pool = HostPool(PoolConfig(size_bytes=4 << 20, show_progress=False))
    reg = FakeRegistrar(base=pool.base, held=(1,))
    pins = pool.pin(reg)
    reg.wait_started(1)
    pins.wait(np.array([0]), None, "test")
    closer = threading.Thread(target=pool.close)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # waiting for chunk 1's registration
    reg.release(1)
    closer.join(WAIT_S)
    assert reg.registered == [0, 1] and sorted(reg.unregistered) == [0, 1]
    with pytest.raises(RuntimeError, match="closed"):
        pool.pin(reg)


@pytest.fixture
def _free_keepers(tmp_path: Path) -> Iterator[None]:
    yield
    for p in tmp_path.iterdir():
        free(p)


@pytest.mark.usefixtures("_free_keepers")
def test_an_unpinnable_pool_file_is_named_to_waiting_copies(tmp_path: Path) -> None:
    """A pool file CUDA refuses to pin: the copies waiting for it read the
    one-line --pool-file error with the fix (and /health's report too)."""
    config = PoolConfig(size_bytes=4 << 20, pool_file=str(tmp_path / "pool.bin"),
                        show_progress=False)  # fmt: skip
    pool = HostPool(config)
    try:
        pins = pool.pin(FakeRegistrar(base=pool.base, fail=0))
        with pytest.raises(DeviceBroken, match="--pool-file: CUDA cannot pin"):
            pins.wait_all()
        assert isinstance(pins.failure, PoolFileError)
        assert "/dev/shm" in str(pins.report()["failed"])
    finally:
        pool.close()


# -- the CUDA copier's wait hook (pegaflow.copiers.cuda_copier), no GPU -------
class PinCheckingKernels:
    """Stand-in kernels: each queued copy records whether every chunk its
    pool side touches was pinned at that moment."""

    def __init__(self, pins: ChunkPins) -> None:
        self.pins = pins
        self.queued: list[tuple[str, bool]] = []

    def _queue(self, direction: str, slots: np.ndarray, t: Transfers) -> None:
        chunks = self.pins.chunks_of(slots, t.nbytes)
        self.queued.append((direction, bool(self.pins.pinned[chunks].all())))

    def gather(self, src: Any, dst: Any, t: Transfers, **kw: Any) -> None:
        self._queue("save", t.dst, t)

    def scatter(self, src: Any, dst: Any, t: Transfers, **kw: Any) -> None:
        self._queue("load", t.src, t)

    def synchronize(self, stream: Any) -> None:
        pass


class KernelPolicy:
    def choose_for(self, direction: str, t: Transfers, device: int) -> str:
        return "kernel"

    def observe(self, *args: Any) -> None:
        pass


def _copier(pins: ChunkPins, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A CudaCopyEngine over stand-ins for the driver and kernels, and one
    worker's regions."""
    for name, fn in (("set_device", lambda ordinal: None),
                     ("create_timing_event", object),
                     ("record_event", lambda event, stream: None)):  # fmt: skip
        monkeypatch.setattr(cuda_driver, name, fn)
    engine = object.__new__(CudaCopyEngine)
    engine._k, engine._policy = PinCheckingKernels(pins), KernelPolicy()
    engine._ctas, engine._attrs, engine._dma, engine._pins = 1, {}, None, pins
    engine._flights, engine._rates, engine._faults = InFlight(), Rates(), Faults()
    streams = (SimpleNamespace(handle=1), SimpleNamespace(handle=2))
    dev = cuda_copier._Device(0, b"gpu0", SimpleNamespace(address=BASE), *streams)
    return engine, SimpleNamespace(device=dev, buffer=None)


def _slot_copy(direction: str, k: int) -> Transfers:
    """32 pages of one block in chunk k, to or from engine memory at 0x1000."""
    steps = np.arange(32, dtype=np.uint64) * np.uint64(4096)
    pages, engine_side = _at(k) + steps, np.uint64(0x1000) + steps
    nbytes = np.full(32, 4096, np.uint64)
    if direction == "save":
        return Transfers(engine_side, pages, nbytes)
    return Transfers(pages, engine_side, nbytes)


def test_a_cuda_copy_never_runs_on_an_unpinned_chunk(monkeypatch) -> None:
    """While the pool is pinned beside serving: the loop's launch declines a
    copy of an unpinned chunk (asking for it first) instead of waiting; a
    copy thread's save waits for its chunk alone; a load whose deadline
    passes meanwhile fails having queued nothing; no copy is ever queued on
    an unpinned chunk; once all are pinned the loop's usual rules are back."""
    reg = FakeRegistrar(held=(0, 1))
    pins = _pins(reg, 4)
    engine, regions = _copier(pins, monkeypatch)
    kernels = engine._k
    reg.wait_started(0)
    assert engine.busy(regions, "load")  # no inline copy on the loop now
    assert engine.launch("load", regions, _slot_copy("load", 2)) is None
    saved: list[bool] = []
    saver = threading.Thread(
        target=lambda: saved.append(
            engine.gather(regions, _slot_copy("save", 3)) is None
        )
    )
    saver.start()
    time.sleep(0.05)
    assert kernels.queued == [] and saved == []
    reg.release(0)
    saver.join(WAIT_S)
    assert saved == [True] and kernels.queued == [("save", True)]
    assert reg.started[:3] == [0, 2, 3] and not pins.pinned[1]
    assert engine.launch("load", regions, _slot_copy("load", 2)) is not None
    with pytest.raises(DeadlineExceeded, match="load: .*nothing was copied"):
        engine.scatter(regions, _slot_copy("load", 1), time.monotonic() + 0.05)
    assert kernels.queued == [("save", True), ("load", True)]
    reg.release(1)
    pins.wait_all()
    engine._flights.add((0, "load"), -1)  # the launched load, as if finished
    assert not engine.busy(regions, "load")
    pins.unpin()


# -- HostRegistrar's chunks, over a stand-in for the CUDA runtime -------------
class FakeRuntime:
    """cudaHostRegister and friends; registered memory's device alias is its
    host address plus `alias_offset` (0 on UVA GPUs: H100, H200)."""

    cudaHostRegisterMapped, cudaHostRegisterPortable = 2, 1

    def __init__(self, alias_offset: int = 0) -> None:
        self.alias_offset = alias_offset
        self.calls: list[tuple[str, int]] = []

    def cudaSetDevice(self, ordinal: int) -> tuple[int]:
        return (0,)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> tuple[int]:
        self.calls.append(("register", address))
        return (0,)

    def cudaHostGetDevicePointer(self, address: int, flags: int) -> tuple[int, int]:
        return 0, address + self.alias_offset

    def cudaHostUnregister(self, address: int) -> tuple[int]:
        self.calls.append(("unregister", address))
        return (0,)


@pytest.mark.parametrize("alias_offset", [0, 1 << 20])
def test_each_chunk_must_be_reachable_at_its_host_address(
    monkeypatch, alias_offset: int
) -> None:
    """The copy engine reaches chunk k at the base's alias plus k's offset:
    a chunk whose alias is elsewhere is unregistered and refused, naming it."""
    rt = FakeRuntime(alias_offset)
    monkeypatch.setattr(cuda_driver, "_rt", lambda: rt)
    registrar = cuda_driver.HostRegistrar(0, CHUNK, threads=2)
    if alias_offset:
        with pytest.raises(CudaError, match="not at its host address"):
            registrar.register_chunk(BASE, CHUNK)
        assert rt.calls == [("register", BASE), ("unregister", BASE)]
        return
    registrar.register_chunk(BASE, CHUNK)
    registrar.unregister_chunk(BASE)
    registrar.register(BASE, 3 * CHUNK)  # the whole pool at once, as before
    registrar.unregister(BASE)
    chunks = [BASE, BASE + CHUNK, BASE + 2 * CHUNK]
    assert sorted(a for c, a in rt.calls[2:] if c == "register") == chunks
    assert sorted(a for c, a in rt.calls[2:] if c == "unregister") == chunks


def test_held_pins_only_what_copies_ask_for_until_released() -> None:
    """hold: while the kernel compiles, only the chunks a wait names are
    pinned (the rest would hold the mmap lock the compile needs); release()
    pins the rest in address order."""
    reg = FakeRegistrar(threads=2)
    pins = _pins(reg, 6, hold=True)
    try:
        pins.wait(pins.chunks_of(_at(4), PAGE), time.monotonic() + WAIT_S, "load")
        time.sleep(0.05)  # a background chunk would have started by now
        assert reg.registered == [4] and not pins.complete
        pins.release()
        pins.wait_all()
        assert sorted(reg.registered) == list(range(6)) and pins.complete
    finally:
        pins.stop()
