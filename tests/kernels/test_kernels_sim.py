"""The CUDA kernels on numba's simulator, against the numpy reference.

The simulator must be switched on before numba.cuda is imported, so the cases
run in two fresh processes (sim_runner.py, one per core); each case is still
reported as its own test here, with the runner's traceback on failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.kernel_cases import all_cases

RUNNER = Path(__file__).with_name("sim_runner.py")
SHARDS = 2
NAMES = ["shim_installed", "rejects_bad_requests", "tables_per_stream_object"]
NAMES += ["a_waiting_stream_holds_no_other", "numpy_checks_before_compiled_loops"]
NAMES += [c.name for c in all_cases()]


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(RUNNER), str(i), str(SHARDS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for i in range(SHARDS)
    ]
    results: dict[str, str] = {}
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"sim_runner failed:\n{err[-4000:]}"
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.parametrize("name", NAMES)
def test_simulated_kernel(name: str, sim_results: dict[str, str]) -> None:
    assert name in sim_results, f"{name}: not run by sim_runner"
    assert sim_results[name] == "", sim_results[name]
