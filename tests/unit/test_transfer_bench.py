"""The CPU-only parts of benchmarks/transfer.py and its --interference mode
(benchmarks/interference.py): they import without torch, parse their
arguments, and build the table and JSON rows from measurements."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import interference
from benchmarks.common import table

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    from benchmarks.transfer import build_parser

    return build_parser().parse_args(list(argv))


def test_imports_and_parses_without_torch() -> None:
    """A machine without torch (or without a GPU) can still import the
    benchmark and read its arguments: torch is imported where it is used."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from benchmarks.transfer import build_parser\n"
        "a = build_parser().parse_args(['--interference', '--copy-paths', 'dma'])\n"
        "print(a.interference, a.copy_paths)\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["True", "['dma']"]


def test_arguments() -> None:
    a = _parse()
    assert not a.interference and a.copy_path == "auto" and a.copy_sm_cap == 66
    assert a.copy_paths == ["kernel", "dma", "auto"]
    assert a.interference_modes == ["save", "load", "both"]
    a = _parse(
        "--interference",
        "--copy-sm-caps",
        "8,132",
        "--copy-paths",
        "kernel,dma",
        "--interference-modes",
        "both",
    )
    assert a.copy_sm_caps == [8, 132] and a.interference_modes == ["both"]
    for bad in (["--copy-sm-caps", "0"], ["--copy-paths", "gpu"], ["--copy-path", "x"]):
        with pytest.raises(SystemExit):
            _parse(*bad)


def test_sizes() -> None:
    assert _parse().sizes is None  # the built-in sweep
    assert _parse("--sizes", "1,64,640").sizes == [1, 64, 640]
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            _parse("--sizes", bad)


def test_settings_sweep_caps_only_where_kernels_run() -> None:
    got = interference.settings(["kernel", "dma", "auto"], [16, 66])
    assert [s.label for s in got] == [
        "kernel/16",
        "kernel/66",
        "dma",
        "auto/16",
        "auto/66",
    ]
    assert got[0].server_args() == ("--copy-path", "kernel", "--copy-sm-cap", "16")
    with pytest.raises(ValueError, match="copy path"):
        interference.settings(["fast"], [1])


def test_copies_count_pro_rata_inside_the_window() -> None:
    ops = [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (5.0, 6.0)]
    # window [0.5, 3]: half of the first, all of the second, half of the third
    assert interference.overlap_bytes(ops, 100, 0.5, 3.0) == pytest.approx(200.0)
    assert interference.overlap_bytes([], 100, 0.0, 1.0) == 0.0


def test_rows_and_table_from_a_fake_result() -> None:
    """Two measured settings, as the GPU run would hand them over: the rows
    carry copy GB/s, its ratio to the ceiling and the matmul's slowdown, and
    the table prints every column of the sweep."""
    n = 8192  # 2 * 8192**3 = 1.0995 TFLOP per matmul
    kernel = dict(
        copy_GBps=50.0,
        copy_alone_GBps=52.0,
        ceiling_GBps=55.0,
        matmul_per_s=400.0,
        matmul_alone_per_s=500.0,
    )
    dma = kernel | {"copy_GBps": 51.3, "matmul_per_s": 490.0}
    rows = [
        interference.row(interference.Setting("kernel", 66), "save", kernel, n),
        interference.row(interference.Setting("dma", 66), "save", dma, n),
    ]
    assert rows[0]["slowdown_pct"] == 20.0 and rows[1]["slowdown_pct"] == 2.0
    assert rows[0]["copy_ratio"] == 0.91 and rows[1]["copy_ratio"] == 0.93
    assert rows[0]["matmul_alone_TFLOPs"] == pytest.approx(549.8, abs=0.1)
    assert rows[1]["setting"] == "dma" and rows[0]["sm_cap"] == 66
    text = table(rows, interference.COLUMNS)
    lines = text.splitlines()
    assert len(lines) == 4 and lines[0].split(" | ")[0].strip() == "setting"
    assert "kernel/66" in lines[2] and "20.0" in lines[2] and "dma" in lines[3]
    args = _parse("--interference")
    payload = interference.payload(args, rows, complete=False)
    assert payload["rows"] == rows and payload["complete"] is False
    assert payload["blocks"] == 640 and payload["matmul_n"] == 8192


def test_auto_rows_carry_the_servers_path_counts() -> None:
    """auto's rows: the share of the window's bytes the copy engines moved
    and the switches, from two /stats counts; forced paths print 0 or 1."""
    before = {"kernel": 100, "dma": 0, "switches": 0}
    after = {"kernel": 125, "dma": 75, "switches": 1}
    delta = interference.path_delta(before, after)
    assert delta == {"dma_share": 0.75, "switches": 1}
    assert interference.path_delta(after, after)["dma_share"] is None
    m = dict(
        copy_GBps=30.0,
        copy_alone_GBps=50.0,
        ceiling_GBps=55.0,
        matmul_per_s=495.0,
        matmul_alone_per_s=500.0,
    )
    auto = interference.Setting("auto", 66)
    settled = interference.row(auto, "save", m | delta, 8192, "settled")
    assert settled["dma_share"] == 0.75 and settled["window"] == "settled"
    assert settled["switches"] == 1 and settled["slowdown_pct"] == 1.0
    dma = interference.row(interference.Setting("dma", 66), "both", m, 8192)
    assert dma["dma_share"] == 1.0 and dma["window"] == "from idle"
    kernel = interference.row(interference.Setting("kernel", 66), "load", m, 8192)
    assert kernel["dma_share"] == 0.0 and kernel["switches"] == 0
    lines = table([settled, dma, kernel], interference.COLUMNS).splitlines()
    assert "settled" in lines[2] and "0.75" in lines[2]


def test_the_originals_benchmark_parses_and_names_a_missing_install(
    tmp_path: Path,
) -> None:
    """benchmarks/transfer_original.py (the Rust PegaFlow 0.25.1 on the same
    workload) reads its flags without the original or torch, and a --site
    without the wheel's server binary is an exit naming it, before anything
    starts."""
    script = ROOT / "benchmarks" / "transfer_original.py"
    got = subprocess.run(
        [sys.executable, str(script), "--site", str(tmp_path), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 1
    assert "pegaflow-server-py" in got.stdout + got.stderr
    assert not list(tmp_path.iterdir())  # nothing written, nothing started
