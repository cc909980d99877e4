"""CPU twin against the numpy reference, plus validation and the table split.

Runs in-process: pegaflow.kernels.cpu never imports numba.cuda.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pegaflow import kernels
from pegaflow.common.errors import InternalError
from pegaflow.common.geometry import Transfers
from tests.kernels.kernel_cases import (
    Case,
    all_cases,
    check,
    host_alloc,
    run_case,
)

cpu = kernels.backend("cpu")
ROOT = Path(__file__).resolve().parents[2]
CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cpu_matches_reference(case: Case) -> None:
    alloc = host_alloc(cpu)
    check(case, run_case(cpu, case, alloc, alloc))


def test_python_fallback_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without numba the descriptor loop runs in Python, with the same result."""
    monkeypatch.setitem(sys.modules, "numba", None)
    cpu._copy_table.cache_clear()
    try:
        assert cpu._copy_table() is cpu._copy_table_py
        alloc = host_alloc(cpu)
        for case in CASES[:3]:
            check(case, run_case(cpu, case, alloc, alloc))
    finally:
        cpu._copy_table.cache_clear()


def test_backend_import_is_cheap() -> None:
    """The package and the CPU twin load without numba.cuda (fresh process)."""
    code = (
        "import sys; from pegaflow import kernels; kernels.backend('cpu'); "
        "sys.exit('numba.cuda' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    with pytest.raises(ValueError, match="backend"):
        kernels.backend("rocm")  # type: ignore[arg-type]


def _setup(nbytes: int = 256) -> tuple:
    src = cpu.wrap_array(kernels.plan.aligned_empty(nbytes))
    dst = cpu.wrap_array(kernels.plan.aligned_empty(nbytes))
    return src, dst


def _t(src: object, dst: object, rows: list[tuple[int, int, int]]) -> Transfers:
    a = np.array(rows, np.uint64).reshape(-1, 3)
    return Transfers(
        a[:, 0] + np.uint64(src.address), a[:, 1] + np.uint64(dst.address), a[:, 2]
    )


@pytest.mark.parametrize(
    ("rows", "field"),
    [
        ([(250, 0, 16)], r"transfers\.src\[0\]"),
        ([(0, 0, 16), (0, 300, 1)], r"transfers\.dst\[1\]"),
        ([(0, 0, 16), (16, 8, 16)], r"transfers\.dst\[1\]: overlaps"),
    ],
)
def test_out_of_bounds_and_overlap_rejected(rows: list, field: str) -> None:
    src, dst = _setup()
    with pytest.raises(InternalError, match=field):
        cpu.gather(src, dst, _t(src, dst, rows), stream=None)


def test_below_base_rejected() -> None:
    src, dst = _setup()
    t = Transfers(
        np.array([src.address - 16], np.uint64),
        np.array([dst.address], np.uint64),
        np.array([16], np.uint64),
    )
    with pytest.raises(InternalError, match=r"transfers\.src\[0\]"):
        cpu.copy_descriptors(src, dst, t, stream=None)


def test_bad_tables_and_launch_args_rejected() -> None:
    src, dst = _setup()
    ok = _t(src, dst, [(0, 0, 16)])
    with pytest.raises(InternalError, match=r"transfers\.nbytes"):
        cpu.scatter(
            src, dst, replace(ok, nbytes=ok.nbytes.astype(np.int64)), stream=None
        )
    with pytest.raises(InternalError, match=r"transfers\.dst: 2 rows"):
        bad = Transfers(ok.src, np.repeat(ok.dst, 2), ok.nbytes)
        cpu.scatter(src, dst, bad, stream=None)
    with pytest.raises(InternalError, match="width"):
        cpu.gather(src, dst, ok, stream=None, width=4)  # type: ignore[arg-type]
    with pytest.raises(InternalError, match="max_blocks"):
        cpu.gather(src, dst, ok, stream=None, max_blocks=0)


def test_wrap_checks_alignment_and_size() -> None:
    mem = kernels.plan.aligned_empty(64)
    with pytest.raises(InternalError, match="address"):
        cpu.wrap(mem.ctypes.data + 8, 32)
    with pytest.raises(InternalError, match="nbytes"):
        cpu.wrap(mem.ctypes.data, 8)
    with pytest.raises(InternalError, match="array"):
        cpu.wrap_array(np.zeros((4, 8), np.uint8)[:, :4])


def test_split_keeps_alignment_and_bytes() -> None:
    """Small requests are cut into 16-byte multiples that copy the same bytes."""
    table = np.array([[16, 4096, 65536], [40, 8, 100], [0, 70000, 0]]).T
    out = kernels.plan.split_table(table, 64, 4096)
    assert out.shape[1] == 16 + 1 + 1  # 64 KiB in 4 KiB pieces, the rest whole
    assert set((out[0] - out[1]).tolist()) == {16 - 4096, 40 - 8, -70000}
    assert (out[2][:16] == 4096).all()
    src = np.random.default_rng(0).integers(0, 256, 70016, dtype=np.uint8)
    want, got = np.zeros((2, 70016), np.uint8)
    cpu._copy_table_py(src, want, table)
    cpu._copy_table_py(src, got, out)
    np.testing.assert_array_equal(got, want)
    assert kernels.plan.split_table(table, 3, 4096) is table  # enough rows


def test_split_of_equal_pages_copies_the_same_bytes() -> None:
    """Equal pages (a small request's usual table; cut by broadcasting when
    the piece divides them): 16-byte multiples, each page's pieces together
    and in order, copying exactly what the uncut table copies."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        n = int(rng.integers(1, 12))
        size = int(rng.choice([256, 512, 4096]))
        pages = rng.permutation(64)[:n]
        table = np.stack([pages * size, rng.permutation(64)[:n] * size,
                          np.full(n, size)]).astype(np.int64)  # fmt: skip
        rows, min_piece = int(rng.integers(n + 1, 200)), int(rng.choice([16, 64]))
        out = kernels.plan.split_table(table, rows, min_piece)
        cuts = out.shape[1] // n
        assert out.shape[1] == n * cuts and out[2].sum() == n * size
        assert (out[2] % 16 == 0).all()
        np.testing.assert_array_equal(
            out[0] - out[1], np.repeat(table[0] - table[1], cuts)
        )
        first = out[:, ::cuts]
        np.testing.assert_array_equal(first[:2], table[:2])  # each page's first piece
        src = rng.integers(0, 256, 64 * size, dtype=np.uint8)
        want, got = np.zeros((2, 64 * size), np.uint8)
        cpu._copy_table_py(src, want, table)
        cpu._copy_table_py(src, got, out)
        np.testing.assert_array_equal(got, want)


def test_split_of_empty_or_unsigned_tables_keeps_them() -> None:
    """Zero-byte descriptors are left as they are (not cut into nothing), and
    an unsigned table is cut into int64 pieces, as the general cut gives."""
    empty = np.array([[0, 16], [64, 80], [0, 0]], np.int64)
    assert kernels.plan.split_table(empty, 64, 16) is empty
    unsigned = np.array([[0], [4096], [4096]], np.uint64)
    out = kernels.plan.split_table(unsigned, 64, 256)
    assert out.dtype == np.int64 and out.shape == (3, 16)
    assert out[2].sum() == 4096 and out[0, -1] == 4096 - 256


def test_disjointness_check_matches_brute_force() -> None:
    """Equal and mixed sizes, runs and shuffles: refused exactly when two
    destination ranges overlap."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(2, 40))
        equal = rng.random() < 0.7
        nbytes = np.full(n, 16) if equal else rng.integers(1, 4, n) * 16
        off = rng.choice(np.arange(0, 64 * 16, 8), n, replace=False)
        if rng.random() < 0.5:
            off = np.sort(off)  # one ascending run, as a block's pages come
        ends = off + nbytes
        clash = any(
            off[i] < ends[j] and off[j] < ends[i]
            for i in range(n)
            for j in range(i + 1, n)
        )
        off_u, nb_u = off.astype(np.uint64), nbytes.astype(np.uint64)
        if clash:
            with pytest.raises(InternalError, match="overlaps"):
                kernels.plan._check_disjoint("transfers.dst", off_u, nb_u)
        else:
            kernels.plan._check_disjoint("transfers.dst", off_u, nb_u)


@pytest.mark.parametrize("op", ["gather", "scatter", "copy_descriptors"])
def test_before_launch_runs_after_the_checks_and_before_the_copy(op: str) -> None:
    """A copier records its start event there (pegaflow.copiers.cuda_copier):
    after the host's table work, before a byte moves; never for a table the
    checks refuse."""
    src = cpu.wrap_array(np.arange(64, dtype=np.uint8))
    dst = cpu.wrap_array(np.zeros(64, np.uint8))
    one = np.ones(1, np.uint64)
    t = Transfers(np.uint64(src.address) * one, np.uint64(dst.address) * one, 32 * one)
    seen: list[int] = []
    before = lambda: seen.append(int(dst.data.sum()))  # noqa: E731
    getattr(cpu, op)(src, dst, t, stream=None, before_launch=before)
    assert seen == [0] and dst.data[:32].tolist() == list(range(32))
    bad = Transfers(t.src, t.dst, 65 * one)  # past the end of both buffers
    with pytest.raises(InternalError):
        cpu.copy_descriptors(src, dst, bad, stream=None,
                             before_launch=lambda: seen.append(-1))  # fmt: skip
    assert seen == [0]
