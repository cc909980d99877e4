"""pegaflow.common.checksum_rows: one compiled call (GIL dropped) gives each slot
row's xxh3-64, the value pegaflow.common.checksums gives for the row's parts."""

from __future__ import annotations

import importlib.util
import threading

import numpy as np
import pytest

from pegaflow.common import checksum_rows
from pegaflow.common.checksums import xxh3_64_parts
from tests.gil import turns_while


@pytest.fixture(params=["native", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fallback":
        monkeypatch.setattr(checksum_rows, "_native", lambda: None)
    elif not checksum_rows.warm():
        pytest.skip("no numba or no XXH3 state API in python-xxhash here")
    return str(request.param)


def _rows(
    rng: np.random.Generator, rows: int, parts: int, each: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(slot addresses [rows, parts] in shuffled order, the pool, the want)."""
    pool = rng.integers(0, 256, max(1, rows * parts * each), np.uint8)
    order = rng.permutation(rows * parts).reshape(rows, parts)
    slots = pool.ctypes.data + order.astype(np.uint64) * np.uint64(each)
    want = [
        xxh3_64_parts([pool[i * each : (i + 1) * each] for i in row])
        for row in order.tolist()
    ]
    return slots, pool, want


@pytest.mark.parametrize(
    "rows,parts,each",
    [(1, 1, 0), (3, 1, 1), (5, 2, 239), (4, 3, 241), (7, 2, 4095), (2, 4, 1 << 18)],
)
def test_each_row_is_xxh3_of_its_parts_back_to_back(
    path: str, rows: int, parts: int, each: int
) -> None:
    rng = np.random.default_rng(rows * 1000 + parts * 10 + each)
    slots, pool, want = _rows(rng, rows, parts, each)
    got = checksum_rows.rows(slots, each)
    assert got.dtype == np.uint64 and got.tolist() == want
    del pool


def test_no_rows_and_bad_shapes(path: str) -> None:
    assert checksum_rows.rows(np.empty((0, 2), np.uint64), 64).size == 0
    with pytest.raises(ValueError, match=r"addrs: need \[rows, parts\]"):
        checksum_rows.rows(np.zeros(3, np.uint64), 64)
    addrs = np.zeros((2, 3), np.uint64)
    with pytest.raises(ValueError, match=r"lengths: need one count or one per part"):
        checksum_rows.rows(addrs, np.ones((3, 2), np.uint64))
    with pytest.raises(ValueError, match=r"lengths: need byte counts"):
        checksum_rows.rows(addrs, -1)
    with pytest.raises(ValueError, match=r"lengths: need byte counts"):
        checksum_rows.rows(addrs, np.full((2, 3), 1.5))


def test_parts_of_their_own_lengths(path: str) -> None:
    """A pool-file row's checksum covers its meta bytes and then its slot:
    parts of unequal lengths, each row its own."""
    rng = np.random.default_rng(17)
    pool = rng.integers(0, 256, 1 << 20, np.uint8)
    lengths = rng.integers(0, 40_000, (9, 3)).astype(np.uint64)
    lengths[0] = 0  # a row of nothing hashes the empty input
    starts = rng.integers(0, pool.size - 40_000, (9, 3)).astype(np.uint64)
    got = checksum_rows.rows(pool.ctypes.data + starts, lengths)
    want = [
        xxh3_64_parts([pool[a : a + n] for a, n in zip(row_a, row_n, strict=True)])
        for row_a, row_n in zip(starts.tolist(), lengths.tolist(), strict=True)
    ]
    assert got.tolist() == want


def test_threads_hash_at_once_each_with_its_own_state(path: str) -> None:
    """Writer threads hash runs at the same time: each keeps its own xxh3
    state, so no run's checksums mix with another's."""
    jobs = [_rows(np.random.default_rng(s), 16, 2, 8192) for s in range(4)]
    got: dict[int, list[int]] = {}

    def run(k: int) -> None:
        slots = jobs[k][0]
        for _ in range(20):
            got[k] = checksum_rows.rows(slots, 8192).tolist()
            if got[k] != jobs[k][2]:
                return

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(got[k] == jobs[k][2] for k in range(4))


def test_the_native_loop_is_used_where_it_can_be() -> None:
    """With numba and python-xxhash's exported XXH3 functions (every wheel
    seen: 3.6.0 and 4.1.0), the writers never fall back to a call per row."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed here")
    assert checksum_rows._native() is not None


def test_a_whole_run_lets_other_threads_run() -> None:
    """The compiled loop runs without the GIL for all its rows: with the
    switch interval raised past the test, a loop that held it would leave
    this thread no turn until the run is hashed. (The fallback's GIL
    release is test_checksums' subject.)"""
    if checksum_rows._native() is None:
        pytest.skip("no numba or no XXH3 state API in python-xxhash here")
    pool = np.ones(256 << 20, np.uint8)
    slots = pool.ctypes.data + np.arange(1024, dtype=np.uint64)[:, None] * (256 << 10)
    checksum_rows.warm()

    def hash_twice() -> None:
        for _ in range(2):
            checksum_rows.rows(slots, 256 << 10)

    turns = turns_while(hash_twice)
    assert turns >= 10, f"{turns} turns while 512 MiB were hashed"


def test_a_library_that_hashes_otherwise_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The compiled loop is checked against python-xxhash before its first
    use; one that gives other values (a library whose XXH3 functions mean
    something else) leaves rows() on python-xxhash, with a warning."""
    if checksum_rows._native() is None:
        pytest.skip("no numba or no XXH3 state API in python-xxhash here")

    def off_by_one(
        state: int, addrs: np.ndarray, lengths: np.ndarray, out: np.ndarray
    ) -> None:
        out[:] = 1

    with pytest.raises(ValueError, match="compiled xxh3 gave 0x1"):
        checksum_rows._self_check(checksum_rows._native()[0], off_by_one)

    def refuse(lib: object, rows_into: object) -> None:
        raise ValueError("compiled xxh3 gave 0x1, want 0x2")

    monkeypatch.setattr(checksum_rows, "_self_check", refuse)
    checksum_rows._native.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pegaflow.common.checksum_rows"):
            assert checksum_rows._native() is None
        assert "through python-xxhash: compiled xxh3 gave" in caplog.text
        rng = np.random.default_rng(9)
        slots, pool, want = _rows(rng, 3, 2, 5000)
        assert checksum_rows.rows(slots, 5000).tolist() == want
    finally:
        checksum_rows._native.cache_clear()


def test_rows_never_compile_on_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before warm() ran, rows() hashes through python-xxhash: compiling there
    held the GIL for seconds in a writer's run (the event loop with it)."""

    caller = threading.current_thread()

    def no_compile() -> None:  # a warm thread of an earlier test may call it
        if threading.current_thread() is caller:
            raise AssertionError("rows() compiled the loop on the caller's thread")

    monkeypatch.setattr(checksum_rows, "_warmed", threading.Event())
    monkeypatch.setattr(checksum_rows, "_native", no_compile)
    slots, _pool, want = _rows(np.random.default_rng(4), 5, 3, 700)
    assert checksum_rows.rows(slots, 700).tolist() == want


def test_a_background_warm_hands_rows_the_compiled_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """warm_in_background() compiles on its own thread, once per process;
    rows() takes the loop from then on (its values the same)."""
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed here")
    monkeypatch.setattr(checksum_rows, "_warmed", threading.Event())
    monkeypatch.setattr(checksum_rows, "_warming", None)
    first = checksum_rows.warm_in_background()
    assert checksum_rows.warm_in_background() is first
    first.join(120)
    assert first.name == "pegaflow-xxh3-warm" and not first.is_alive()
    native = checksum_rows._native()
    if native is None:
        pytest.skip("no XXH3 state API in python-xxhash here")
    lib, loop = native
    used: list[int] = []

    def spy(*args: object) -> None:
        used.append(len(args[1]))
        loop(*args)

    monkeypatch.setattr(checksum_rows, "_native", lambda: (lib, spy))
    slots, _pool, want = _rows(np.random.default_rng(5), 4, 2, 3000)
    assert checksum_rows.rows(slots, 3000).tolist() == want
    assert used == [4]  # rows() went to the compiled loop, all 4 rows at once
