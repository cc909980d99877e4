"""The CPU-only parts of benchmarks/transfer_gpus.py (transfer.py --gpus N):
it imports and parses without torch, steps through 1, 2, 4 .. N GPUs, and
measures the host's memcpy ceiling."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import transfer_gpus

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    from benchmarks.transfer import build_parser

    return build_parser().parse_args(list(argv))


def test_gpus_flag_defaults_to_todays_single_gpu_run() -> None:
    assert _parse().gpus == 1
    assert _parse("--gpus", "8").gpus == 8


@pytest.mark.parametrize("bad", ["0", "17", "two", "-1"])
def test_gpus_flag_is_range_checked(bad: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _parse("--gpus", bad)
    assert "need 1..16 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpus", "steps"), [(1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (8, [1, 2, 4, 8])]
)
def test_counts_step_by_powers_of_two(gpus: int, steps: list[int]) -> None:
    assert transfer_gpus.counts(gpus) == steps


def test_host_memcpy_moves_every_byte_and_gives_a_rate() -> None:
    assert transfer_gpus.host_memcpy_gbps(1 << 20, threads=3) > 0


def test_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from benchmarks import transfer_gpus\n"
        "print(transfer_gpus.counts(4))\n"
    )
    got = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["[1,", "2,", "4]"]
