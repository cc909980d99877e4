"""gds.io.copy_within: the staged path's copies, one compiled call without
the GIL for a run's rows (a ctypes memmove per row where numba is missing)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pegaflow.gds import io as gds_io
from tests.gil import turns_while


@pytest.fixture(params=["compiled", "ctypes"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "ctypes":
        monkeypatch.setattr(gds_io, "_compiled_copy", lambda: None)
    elif not gds_io.warm_copies():
        pytest.skip("numba is not installed here")
    return str(request.param)


@pytest.mark.parametrize("rows,nbytes", [(0, 64), (1, 0), (5, 1), (17, 5000)])
def test_each_row_lands_where_it_is_sent(path: str, rows: int, nbytes: int) -> None:
    """Rows from shuffled places of a source into rows of a destination with
    gaps between them: every byte where it belongs, the gaps untouched."""
    rng = np.random.default_rng(rows * 7 + nbytes)
    src = rng.integers(0, 256, max(1, rows * nbytes), np.uint8)
    dst = np.full(max(1, rows * (nbytes + 3)), 0xEE, np.uint8)
    order = rng.permutation(rows).astype(np.uint64)
    at = np.arange(rows, dtype=np.uint64) * np.uint64(nbytes + 3)
    gds_io.copy_within(
        dst.ctypes.data + at, src.ctypes.data + order * np.uint64(nbytes), nbytes
    )
    want = np.full_like(dst, 0xEE)
    for i, k in enumerate(order.tolist()):
        want[i * (nbytes + 3) : i * (nbytes + 3) + nbytes] = src[
            k * nbytes : (k + 1) * nbytes
        ]
    assert np.array_equal(dst, want)


def test_the_compiled_copy_is_used_where_numba_is() -> None:
    if importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed here")
    assert gds_io.warm_copies()


def test_a_run_of_copies_lets_other_threads_run() -> None:
    """One call for all rows, without the GIL: with the switch interval
    raised past the test, a copy loop that held it would leave this thread
    no turn until every row is copied."""
    if not gds_io.warm_copies():
        pytest.skip("numba is not installed here")
    src = np.ones(64 << 20, np.uint8)
    dst = np.empty_like(src)
    rows = np.arange(256, dtype=np.uint64) * np.uint64(256 << 10)

    def copy_often() -> None:
        for _ in range(8):
            gds_io.copy_within(
                dst.ctypes.data + rows, src.ctypes.data + rows, 256 << 10
            )

    turns = turns_while(copy_often)
    assert turns >= 10, f"{turns} turns while 512 MiB were copied"
    assert dst.all()


def test_a_copy_that_moves_other_bytes_is_not_used(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The compiled loop is checked on a few rows when compiled; one that
    copies wrong (here: a numba whose compiled loops do nothing) leaves the
    copies to ctypes, with a warning."""
    numba = pytest.importorskip("numba")  # the compiler the loop comes from

    def no_op_njit(**options: object) -> object:
        return lambda fn: lambda *args: None

    monkeypatch.setattr(numba, "njit", no_op_njit)
    gds_io._compiled_copy.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="pegaflow.gds.io"):
            assert not gds_io.warm_copies()
        assert "the compiled copy moved other bytes" in caplog.text
    finally:
        monkeypatch.undo()
        gds_io._compiled_copy.cache_clear()


def test_rows_that_do_not_pair_up_are_refused(path: str) -> None:
    """A destination per source, or nothing is copied (the compiled loop
    would read past the shorter array)."""
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match=r"copy_within: \(2,\) destinations"):
        gds_io.copy_within(
            np.full(2, buf.ctypes.data, np.uint64),
            np.full(1, buf.ctypes.data, np.uint64),
            8,
        )
