"""The CPU-side parts of benchmarks/kernel_variants.py: arguments, the byte
checks (they must catch a wrong or a stray byte), ratios and the tables. The
checks run over SimMem with the CPU twin, which has the same buffer API."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import kernel_variants, kernel_variants_paths
from benchmarks.kernel_variants_mem import POISON, SimMem
from pegaflow import kernels

cpu = kernels.backend("cpu")


def test_arguments() -> None:
    args = kernel_variants.parse_args([])
    assert args.sizes == (1, 8, 64, 640, 2560)
    assert args.only == {"latency", "gather", "scatter", "both"}
    args = kernel_variants.parse_args(["--simulate", "--only", "both"])
    assert args.sizes == kernel_variants.SIM_SIZES and args.only == {"both"}
    with pytest.raises(SystemExit):
        kernel_variants.parse_args(["--only", "fast"])


def test_checks_catch_wrong_and_stray_bytes() -> None:
    m = SimMem(cpu)
    ids, slots = np.array([3, 7]), np.array([1, 4])
    m.poison_pool()
    cpu.gather(m.eng, m.pool, m.save_t(ids, slots), stream=None)
    assert m.check_gather(ids, slots)
    assert not m.check_gather(ids, slots[::-1])  # pages in the wrong slots
    m.pool_v()[0, 0, 0] = 0  # a byte written outside the saved slots
    assert not m.check_gather(ids, slots)
    m.randomize_pool()
    m.poison_back()
    cpu.scatter(m.pool, m.eng_back, m.load_t(ids, slots), stream=None)
    assert m.check_scatter(ids, slots)
    m.back_v[0, 0, 0] = POISON ^ 1
    assert not m.check_scatter(ids, slots)


def test_ratios_and_tables() -> None:
    ceiling = kernel_variants_paths.CEILING
    rows = [
        {"op": "gather", "variant": ceiling, "N": 8, "gbps": 50.0, "ok": True},
        {"op": "gather", "variant": "warp 256", "N": 8, "gbps": 45.0, "ok": True},
        {"op": "gather", "variant": "dma", "N": 8, "ok": False, "error": "boom"},
        {"op": "lat_gather", "variant": "x", "N": 1, "p50_us": 90.0, "p90_us": 99.0,
         "ok": True},
    ]  # fmt: skip
    kernel_variants_paths.add_ratios(rows)
    assert rows[1]["ratio"] == pytest.approx(0.9)
    text = kernel_variants_paths.tables(rows, (8, 64))
    assert "45.0 (0.90)" in text and "ERROR" in text and "boom" in text
    assert "| 90 " in text or " 90 |" in text


def test_split_cells_move_every_byte_once() -> None:
    """The split benchmark's cells (a share by the second path, the rest by
    the first, both directions at once) on the CPU twin: every byte checked."""
    from benchmarks import kernel_variants_split as split

    r = kernel_variants_paths.Run(cpu, SimMem(cpu), None, None, True, 2, 2, math.inf)
    for op in ("gather", "scatter"):
        split.run_direction(r, op, (4, 5), (0.0, 0.4, 1.0))
    split.both_ceiling(r)
    split.run_both(r, (0.0, 0.5))
    moved = [x for x in r.rows if x["variant"] != kernel_variants_paths.CEILING]
    assert len(moved) == 2 * 2 * 4 + 4
    assert all(x["ok"] is True for x in r.rows), [x for x in r.rows if not x["ok"]]
    kernel_variants_paths.add_ratios(r.rows)
    text = kernel_variants_paths.tables(r.rows, (4, 5))
    assert "dma 40% + kernel" in text and "save + load at once, N=3" in text


@pytest.mark.parametrize("contiguous", [False, True])
def test_a_save_and_a_load_at_once_use_disjoint_slots(contiguous: bool) -> None:
    m = SimMem(cpu)
    r = kernel_variants_paths.Run(cpu, m, None, None, True, 2, 2, math.inf)
    r.contiguous_slots = contiguous
    ia, ic, ib, sa, sb = kernel_variants_paths.both_picks(r, 3)
    assert not set(ia) & set(ic) and len(set(ib)) == 3
    assert not set(sa.tolist()) & set(sb.tolist())
    if contiguous:  # one run of adjacent slots each
        assert (np.diff(sa) == 1).all() and sb[0] == sa[-1] + 1
