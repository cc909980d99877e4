"""The worker's I/O threads leave the core vLLM pinned its main thread to, but
never the CPUs the engine's threads were given. Each case runs in a fresh
interpreter: CPU masks are per thread and inherited."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.procs import ROOT

# As vLLM's CPU worker binds OpenMP: the main thread to the first CPU, another
# thread to the second; then the connector starts its pool.
PINNED = """
import json, os, threading
from connector.io_threads import io_pool
cpus = sorted(os.sched_getaffinity(0))
first, second = cpus[0], cpus[1]
os.sched_setaffinity(0, {first})
ready, done = threading.Event(), threading.Event()
def omp_thread():
    os.sched_setaffinity(0, {second})
    ready.set()
    done.wait()
threading.Thread(target=omp_thread, daemon=True).start()
ready.wait()
pool = io_pool(2, "t")
mask = pool.submit(lambda: sorted(os.sched_getaffinity(0))).result()
done.set()
print(json.dumps({"io": mask, "main": sorted(os.sched_getaffinity(0)),
                  "want": sorted({first, second})}))
"""

# A process an operator confined to one CPU (taskset): the pool stays there.
CONFINED = """
import json, os
from connector.io_threads import io_pool
one = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {one})
pool = io_pool(1, "t")
print(json.dumps({"io": pool.submit(lambda: sorted(os.sched_getaffinity(0))).result(),
                  "want": [one]}))
"""


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_io_threads_leave_the_pinned_core() -> None:
    got = _run(PINNED)
    assert got["io"] == got["want"]
    assert len(got["main"]) == 1  # the engine's own threads are left as they are


def test_io_threads_stay_within_what_the_operator_allowed() -> None:
    got = _run(CONFINED)
    assert got["io"] == got["want"]
