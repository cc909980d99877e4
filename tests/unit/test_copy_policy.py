"""Kernel or copy engines, per batch (pegaflow.copiers.cuda_copier.CopyPolicy), and
what feeds it: CudaConfig.copy_path (--copy-path) and the measured crossover
table (pegaflow.copiers.measured.CROSSOVERS)."""

from __future__ import annotations

import numpy as np
import pytest

from pegaflow.common.geometry import Transfers
from pegaflow.common.settings import CudaConfig
from pegaflow.copiers.cuda_copier import CopyPolicy
from pegaflow.copiers.measured import COMPLETION, CROSSOVERS, Crossover
from pegaflow.server.cli import build_parser, config_from_args

LAYERS, PAGE = 32, 64 << 10


def test_default_table_follows_the_h200_figures() -> None:
    """DMA for saves of 1-4 blocks x 32 layers of 64 KiB pages (copy engines +
    mapped flag beat the kernel at N = 1, lose from N = 8; 2026-12-02);
    kernels above, kernels for every load, kernels for pages smaller than
    measured. The 2560-block DMA row of 2026-12-01 is gone (kernels won there)."""
    auto = CopyPolicy.from_config(CudaConfig())
    for n in (1, 2, 4):
        assert auto.choose("save", n * LAYERS, PAGE) == "dma"
    assert auto.choose("save", 4 * LAYERS + 1, PAGE) == "kernel"
    for n in (8, 64, 640, 2559, 2560, 10_000):
        assert auto.choose("save", n * LAYERS, PAGE) == "kernel"
    assert auto.choose("save", LAYERS, 4096) == "kernel"
    assert auto.choose("save", 2 * 61, 64 * 576 * 2) == "dma"  # 2 MLA blocks
    assert auto.choose("save", 3 * 61, 64 * 576 * 2) == "kernel"
    for n in (1, 4, 64, 640, 2560, 10_000):
        assert auto.choose("load", n * LAYERS, PAGE) == "kernel"


def test_completion_follows_the_path() -> None:
    """Copy engines end with the mapped flag, kernels with a stream sync."""
    assert COMPLETION == {"dma": "flag", "kernel": "sync"}


@pytest.mark.parametrize("setting", ["kernel", "dma"])
def test_a_forced_path_wins_over_the_table(setting: str) -> None:
    forced = CopyPolicy(setting, CROSSOVERS)  # type: ignore[arg-type]
    for direction in ("save", "load"):
        for pages in (1, 2560 * LAYERS):
            assert forced.choose(direction, pages, PAGE) == setting


def test_rows_apply_per_direction_and_page_size() -> None:
    policy = CopyPolicy("auto", (Crossover("load", 100, 8192), Crossover("load", 1000)))
    assert policy.choose("load", 100, 8192) == "dma"
    assert policy.choose("load", 100, 8191) == "kernel"
    assert policy.choose("load", 1000, 16) == "dma"  # the second row
    assert policy.choose("save", 10**6, PAGE) == "kernel"
    assert CopyPolicy().choose("save", 10**6, PAGE) == "kernel"  # no rows


def test_choose_for_reads_the_shape_of_a_table() -> None:
    policy = CopyPolicy("auto", (Crossover("save", 4, 1024),))

    def table(pages: int, size: int) -> Transfers:
        a = np.arange(pages, dtype=np.uint64) * np.uint64(size) + np.uint64(1 << 20)
        return Transfers(a, a + np.uint64(1 << 30), np.full(pages, size, np.uint64))

    assert policy.choose_for("save", table(4, 1024)) == "dma"
    assert policy.choose_for("save", table(3, 1024)) == "kernel"
    assert policy.choose_for("save", table(4, 1008)) == "kernel"
    assert policy.choose_for("save", table(0, 1024)) == "kernel"


def test_rows_with_a_page_range() -> None:
    policy = CopyPolicy("auto", (Crossover("save", 2, 0, max_pages=10),))
    assert [policy.choose("save", n, PAGE) for n in (1, 2, 10, 11)] == [
        "kernel",
        "dma",
        "dma",
        "kernel",
    ]
    bad_rows = (
        {"max_pages": 9},
        {"direction": "both"},
        {"min_pages": 0},
        {"min_page_bytes": -1},
    )
    for bad in bad_rows:
        row = {"direction": "save", "min_pages": 10, **bad}
        with pytest.raises(ValueError, match="crossover"):
            Crossover(**row)  # type: ignore[arg-type]


def test_config_refuses_an_unknown_path() -> None:
    with pytest.raises(ValueError, match="copy_path"):
        CudaConfig(copy_path="fast")  # type: ignore[arg-type]


def test_flags_reach_the_config() -> None:
    """--copy-path sets the path; the table is the measured one, every path."""

    def cuda(*argv: str) -> CudaConfig:
        return config_from_args(build_parser().parse_args(list(argv))).cuda

    assert cuda().copy_path == "auto"
    assert CopyPolicy.from_config(cuda()).crossovers == CROSSOVERS
    assert cuda("--copy-sm-cap", "33").max_ctas == 33
    assert cuda("--copy-ctas", "17").max_ctas == 17  # the older spelling
    for setting in ("auto", "kernel", "dma"):
        got = cuda("--copy-path", setting)
        assert got.copy_path == setting
        assert CopyPolicy.from_config(got).setting == setting
