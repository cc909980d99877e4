"""Run the kernel cases on numba's CUDA simulator; print {name: traceback or ""}.

test_kernels_sim.py starts this in fresh processes: NUMBA_ENABLE_CUDASIM must be
set before numba.cuda is first imported, and setting it in the pytest process
would leak into every other test (the gpu tests need the real numba.cuda).

    python tests/kernels/sim_runner.py SHARD NSHARDS
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

# Pretend to be numpy >= 2.5, which dropped row_stack: kernels.cuda must cope.
if hasattr(np, "row_stack"):
    del np.row_stack

from pegaflow import kernels  # noqa: E402
from pegaflow.common.errors import InternalError  # noqa: E402
from pegaflow.common.geometry import Transfers  # noqa: E402
from pegaflow.kernels import table_jit  # noqa: E402
from tests.kernels.kernel_cases import (  # noqa: E402
    all_cases,
    check,
    host_alloc,
    run_case,
)

PLAIN = "lbnhc"  # the case the stream tests copy


def shim_installed() -> None:
    assert np.row_stack is np.vstack


def rejects_bad_requests() -> None:
    """The CUDA wrappers validate before launching, naming the field."""
    k = kernels.backend("cuda")
    src = k.wrap_array(kernels.plan.aligned_empty(64))
    dst = k.wrap_array(kernels.plan.aligned_empty(64))
    t = Transfers(
        np.array([src.address + 60], np.uint64),
        np.array([dst.address], np.uint64),
        np.array([16], np.uint64),
    )
    for call in (k.gather, k.scatter):
        try:
            call(src, dst, t, stream=k.stream())
        except InternalError as e:
            assert "transfers.src[0]" in str(e), e
        else:
            raise AssertionError("out-of-bounds source accepted")


def tables_per_stream_object() -> None:
    """Each stream object has its own descriptor tables, gone with the stream
    (a later stream that reuses its handle value starts with none)."""
    import gc

    k = kernels.backend("cuda")
    by = {c.name: c for c in all_cases()}
    alloc = host_alloc(k)
    streams = k._kernels._streams
    before = len(streams)
    first, second = k.stream(), k.stream()
    case = by[PLAIN]
    for stream in (first, second):
        check(case, run_case(k, case, alloc, alloc, stream=stream))
    mine = [streams[first], streams[second]]
    assert len(streams) == before + 2 and mine[0] is not mine[1]
    tables = [t for m in mine for t in m.tables if t is not None]
    assert len({id(t) for t in tables}) == len(tables) >= 2  # none shared
    del first, second, stream, mine, tables
    gc.collect()
    assert len(streams) == before, "a dropped stream's tables stayed"


def a_waiting_stream_holds_no_other() -> None:
    """A launch waiting for its stream's table (the kernel that last read it
    still running) must not hold up a launch on another stream: the save and
    load streams go on while either waits. Fails with one lock for all streams."""
    import threading

    k = kernels.backend("cuda")
    case = {c.name: c for c in all_cases()}[PLAIN]
    alloc = host_alloc(k)
    busy, free = k.stream(), k.stream()
    for _ in range(2):  # both of busy's tables in use once
        check(case, run_case(k, case, alloc, alloc, stream=busy))
    parked, release = threading.Event(), threading.Event()

    class Pending:  # the event after the launch that last read the table
        def synchronize(self) -> None:
            parked.set()
            assert release.wait(180), "never released"

        def record(self, stream: object) -> None:
            pass

    mine = k._kernels._streams[busy]
    mine.tables[mine.turn ^ 1].done = Pending()
    got: dict[str, np.ndarray] = {}

    def run(name: str, stream: object) -> None:
        try:
            got[name] = run_case(k, case, alloc, alloc, stream=stream)
        except Exception as e:  # reported below, by name
            got[name] = e  # type: ignore[assignment]

    waiting = threading.Thread(target=run, args=("busy", busy))
    waiting.start()
    # The simulator swaps this module's `cuda` global for its fake while a
    # kernel runs: the other launch starts only once busy is parked, so no
    # thread touches numba.cuda during a simulated launch.
    assert parked.wait(120), "the busy launch never reached its table"
    other = threading.Thread(target=run, args=("free", free))
    other.start()
    # Busy waits until released, so a launch that finishes at all got past it;
    # the bound only ends a wait that would never end (one lock for all).
    other.join(120)
    finished_first = not other.is_alive()
    release.set()
    waiting.join(120)
    other.join(120)
    assert finished_first, "a launch on another stream waited for the busy one"
    for result in got.values():
        if isinstance(result, Exception):
            raise result
    check(case, got["busy"])
    check(case, got["free"])


def numpy_checks_before_compiled_loops() -> None:
    """Until table_jit's compiled loops are loaded (a server's start loads
    them on a thread), tables are checked and split by plan's numpy twins:
    the same bytes, the same refusals."""
    from pegaflow.kernels import cuda as backend

    k = kernels.backend("cuda")
    calls: list[str] = []
    saved = table_jit.ready, backend.descriptor_table, backend.split_table

    def counted(name: str, fn: Callable) -> Callable:
        return lambda *a: calls.append(name) or fn(*a)

    table_jit.ready = lambda: False
    backend.descriptor_table = counted("check", saved[1])
    backend.split_table = counted("split", saved[2])
    try:
        alloc = host_alloc(k)
        for case in all_cases()[:4]:
            check(case, run_case(k, case, alloc, alloc))
        rejects_bad_requests()
    finally:
        table_jit.ready, backend.descriptor_table, backend.split_table = saved
    assert {"check", "split"} <= set(calls), calls


def main(shard: int, shards: int) -> dict[str, str]:
    k = kernels.backend("cuda")
    assert k.SIMULATED, "simulator not active"
    table_jit.compiled()  # every case below on the compiled checks
    alloc = host_alloc(k)
    jobs: list[tuple[str, Callable[[], None]]] = [
        ("shim_installed", shim_installed),
        ("rejects_bad_requests", rejects_bad_requests),
        ("tables_per_stream_object", tables_per_stream_object),
        ("a_waiting_stream_holds_no_other", a_waiting_stream_holds_no_other),
        ("numpy_checks_before_compiled_loops", numpy_checks_before_compiled_loops),
    ]
    for case in all_cases():
        jobs.append((case.name, lambda c=case: check(c, run_case(k, c, alloc, alloc))))
    results = {}
    for name, job in jobs[shard::shards]:
        try:
            job()
            results[name] = ""
        except Exception:  # reported per case by the pytest side
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
