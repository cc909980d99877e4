"""benchmarks/ssd.py keeps what it measured when a run is cut short (the H200
device call: the posix run finished its rows, then hit its stage limit and
wrote no JSON)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

from benchmarks import ssd as bench


class _Killed(Exception):
    """What SIGTERM does here unless the benchmark handles it itself."""


def _guard(signum: int, frame: object) -> None:
    raise _Killed


def test_sigterm_in_a_late_stage_keeps_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scenario: a small run whose rows are done gets SIGTERM in the stage after
    them (the 4-stream dd). The JSON is there, names the stage it was cut
    in, is marked incomplete and holds the row measured before."""
    out = tmp_path / "ssd.json"
    argv = ["ssd.py", "--quick", "--total", "0.01", "--blocks", "256"]
    argv += ["--depths", "1", "--skip-recovery", "--dir", str(tmp_path / "d")]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])

    def dd_then_sigterm(*args: object, **kwargs: object) -> dict[str, float]:
        if kwargs.get("streams") == 4:  # the stage after the rows
            signal.raise_signal(signal.SIGTERM)
        return real_dd(*args, **kwargs)

    real_dd = bench.dd
    monkeypatch.setattr(bench, "dd", dd_then_sigterm)
    before = signal.signal(signal.SIGTERM, _guard)
    try:
        assert bench.main() == 130
    finally:
        signal.signal(signal.SIGTERM, before)
    got = json.loads(out.read_text())
    assert got["complete"] is False
    assert got["interrupted_in"] == "row 256 KiB x1"
    assert len(got["rows"]) == 1 and got["rows"][0]["block_KiB"] == 256
    assert "dd_calibration" in got and "dd" not in got
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temp
