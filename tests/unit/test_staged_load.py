"""Loads staged through a GPU buffer (pegaflow.copiers.staged_load) on the
CPU twins: the kernels' CPU backend scatters, and the copy-engine batch is the
real ctypes binding called on test_dma_batch's stand-in for libcuda's entry
point, which moves the bytes. The same path on numba's CUDA simulator is in
tests/kernels/sim_runner.py."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers
from pegaflow.copiers import dma, staged_load
from pegaflow.copiers.staged_load import LoadStaging, open_staging, parts
from pegaflow.kernels import backend
from pegaflow.kernels.plan import aligned_empty
from tests.unit.test_dma_batch import FakeLib

cpu = backend("cpu")
PAGE = 256  # bytes of one (layer, block) page here
LAYERS = 3
SLOT = LAYERS * PAGE  # a pool slot: the block's pages of every layer, end to end
STREAM = SimpleNamespace(handle=0x5150)


def _random_buffer(nbytes: int, rng: np.random.Generator) -> tuple[object, np.ndarray]:
    mem = aligned_empty(nbytes)
    mem[:] = rng.integers(0, 256, nbytes, np.uint8)
    return cpu.wrap(mem.ctypes.data, nbytes, owner=mem), mem


def load_table(pool: object, engine: object, slots: np.ndarray, blocks: np.ndarray,
          engine_blocks: int) -> Transfers:  # fmt: skip
    """A load as the server builds it: block-major, each slot's rows in slot
    order; the engine holds layer-major pages ([layer][block])."""
    layer = np.arange(LAYERS, dtype=np.uint64)
    src = (
        np.uint64(pool.address)
        + slots.astype(np.uint64)[:, None] * np.uint64(SLOT)
        + layer[None, :] * np.uint64(PAGE)
    )
    dst = np.uint64(engine.address) + (
        layer[None, :] * np.uint64(engine_blocks) + blocks.astype(np.uint64)[:, None]
    ) * np.uint64(PAGE)
    n = np.full(src.size, PAGE, np.uint64)
    return Transfers(src=src.ravel(), dst=dst.ravel(), nbytes=n)


def _staging(capacity: int, lib: FakeLib, kernels: object = cpu) -> LoadStaging:
    lib.execute = True
    pool_chunks = (0, 1 << 40)  # no registration edge inside these buffers
    return LoadStaging(
        kernels,
        cpu.staging_buffer(capacity),
        dma.bind(lib),
        dma.attributes("load", 0),
        pool_chunks,
    )


def test_parts_cut_whole_rows_at_the_capacity() -> None:
    n = np.array([4, 4, 4, 8, 2, 6], np.uint64)
    assert parts(n, 8) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 6)]
    assert parts(n, 100) == [slice(0, 6)]
    assert parts(n, 7) is None  # the 8-byte row fits no part
    assert parts(np.zeros(0, np.uint64), 8) == []


def test_a_staged_load_moves_the_bytes_a_direct_scatter_moves() -> None:
    """Random slots into random engine blocks, the buffer smaller than the
    load (three parts): the engine's bytes equal a direct scatter's, other
    bytes untouched; each part is one batch whose copies are whole slots."""
    rng = np.random.default_rng(3)
    pool_slots, engine_blocks, loaded = 40, 32, 10
    pool, _ = _random_buffer(pool_slots * SLOT, rng)
    got, got_mem = _random_buffer(LAYERS * engine_blocks * PAGE, rng)
    want_mem = got_mem.copy()
    want = cpu.wrap(want_mem.ctypes.data, want_mem.nbytes, owner=want_mem)
    slots = rng.permutation(pool_slots)[:loaded]
    slots[3] = slots[2] + 1 if slots[2] + 1 not in slots else slots[3]
    blocks = rng.permutation(engine_blocks)[:loaded]
    lib = FakeLib()
    staging = _staging(4 * SLOT, lib)

    t = load_table(pool, got, slots, blocks, engine_blocks)
    assert staging.fits(t)
    staging.queue(pool, got, t, STREAM, 8)
    cpu.scatter(
        pool, want, load_table(pool, want, slots, blocks, engine_blocks), stream=None
    )

    assert np.array_equal(got_mem, want_mem)
    assert len(lib.calls) == 3  # 10 slots through a 4-slot buffer
    sizes = np.concatenate([c["sizes"] for c in lib.calls])
    assert int(sizes.sum()) == loaded * SLOT
    assert (sizes % SLOT == 0).all()  # a slot's rows went as one copy
    assert all(c["stream"] == STREAM.handle for c in lib.calls)


def test_a_row_outside_the_pool_is_refused_before_any_copy() -> None:
    rng = np.random.default_rng(4)
    pool, _ = _random_buffer(4 * SLOT, rng)
    engine, mem = _random_buffer(LAYERS * 8 * PAGE, rng)
    before = mem.copy()
    # slot 4 lies past the pool
    t = load_table(pool, engine, np.array([0, 4]), np.array([1, 2]), 8)
    lib = FakeLib()
    with pytest.raises(InternalError, match=r"transfers.src\["):
        _staging(8 * SLOT, lib).queue(pool, engine, t, STREAM, 8)
    assert not lib.calls and np.array_equal(mem, before)


def test_a_row_larger_than_the_buffer_does_not_fit() -> None:
    t = Transfers(
        np.zeros(2, np.uint64), np.zeros(2, np.uint64), np.array([8, 64], np.uint64)
    )
    staging = _staging(32, FakeLib())
    assert not staging.fits(t)
    assert staging.fits(Transfers(t.dst[:1], t.src[:1], t.nbytes[:1]))


def test_two_threads_loads_do_not_interleave_their_parts() -> None:
    """On a GPU the parts are only queued: a second load's batch queued between
    a first load's batch and its scatter would overwrite the staged pages the
    scatter reads. The first load's first batch waits (a bounded while) for
    the other thread to queue anything: with the lock, it cannot."""
    rng = np.random.default_rng(5)
    pool, _ = _random_buffer(16 * SLOT, rng)
    engines = [_random_buffer(LAYERS * 8 * PAGE, rng) for _ in range(2)]
    order: list[str] = []
    other_started = threading.Event()

    class Recording(FakeLib):
        def _v2(self, *args: object) -> int:
            who = threading.current_thread().name
            order.append(f"{who}:dma")
            if who == "first" and len(order) == 1:
                other_started.set()
                time.sleep(0.2)  # time for "second" to queue, were it free to
            return super()._v2(*args)

    class Kernels:
        def scatter(self, *args: object, **kw: object) -> None:
            order.append(f"{threading.current_thread().name}:scatter")
            cpu.scatter(*args, **kw)

    staging = _staging(2 * SLOT, Recording(), Kernels())
    loads = [
        load_table(pool, e, np.arange(4) + 4 * i, np.arange(4), 8)
        for i, (e, _) in enumerate(engines)
    ]

    def run(i: int) -> None:
        staging.queue(pool, engines[i][0], loads[i], STREAM, 8)

    first = threading.Thread(target=run, args=(0,), name="first")
    first.start()
    assert other_started.wait(10)
    second = threading.Thread(target=run, args=(1,), name="second")
    second.start()
    first.join(10)
    second.join(10)
    owners = [step.split(":")[0] for step in order]
    assert owners == ["first"] * 4 + ["second"] * 4, order
    for i, (_, mem) in enumerate(engines):
        want = np.zeros_like(mem)
        ref = cpu.wrap(want.ctypes.data, want.nbytes, owner=want)
        t = load_table(pool, ref, np.arange(4) + 4 * i, np.arange(4), 8)
        cpu.scatter(pool, ref, t, stream=None)
        rows = np.arange(LAYERS)[:, None] * 8 + np.arange(4)[None, :]
        pages = mem.reshape(LAYERS * 8, PAGE)[rows.ravel()]
        assert np.array_equal(pages, want.reshape(LAYERS * 8, PAGE)[rows.ravel()])


def test_staging_is_off_at_zero_and_without_the_drivers_batch_call(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert open_staging(cpu, 0, 0, None, (0, 1)) is None

    def no_driver() -> None:
        raise dma.cuda_driver.CudaError("cuMemcpyBatchAsync: not in this driver")

    monkeypatch.setattr(staged_load.dma, "driver", no_driver)
    with caplog.at_level(logging.WARNING):
        assert open_staging(cpu, 3, 1 << 20, None, (0, 1)) is None
    assert "--load-staging-mib: off on device 3" in caplog.text
    got = open_staging(cpu, 0, 4096, dma.bind(FakeLib()), (0, 1))
    assert got is not None and got.buffer.nbytes == 4096
