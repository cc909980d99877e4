"""CudaCopyEngine serving several GPUs, under numba's CUDA simulator: ranks
routed to their own device's state by UUID, a GPU the server does not serve
refused naming --devices, mappings per (device, handle), a broken GPU leaving
the others copying. The cases run in one fresh process (multi_device_runner.py:
the simulator must be on before numba.cuda is imported); each is reported as
its own test here, with the runner's traceback on failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).with_name("multi_device_runner.py")
# Named here, not imported: importing the runner would switch the simulator on
# in this process (and for every later test in it).
NAMES = [
    "each_rank_copies_on_its_own_device",
    "a_gpu_not_served_is_refused_naming_the_flag",
    "one_handle_per_device_and_allocation",
    "a_broken_gpu_leaves_the_others_copying",
]


@pytest.fixture(scope="module")
def sim_results() -> dict[str, str]:
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "1"}
    proc = subprocess.run(
        [sys.executable, str(RUNNER)],
        capture_output=True,
        env=env,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"multi_device_runner failed:\n{proc.stderr[-4000:]}"
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(NAMES), "NAMES and the runner's JOBS differ"
    return results


@pytest.mark.parametrize("name", NAMES)
def test_simulated_devices(name: str, sim_results: dict[str, str]) -> None:
    assert name in sim_results, f"{name}: not run by multi_device_runner"
    assert sim_results[name] == "", sim_results[name]
