"""Run the server with named functions timed, for where a request's time goes
(issue 12: the 1-block load's server-side copy took 0.26-0.36 ms on the H200
while the same copier alone took 0.13).

Wraps each target ("module:Class.method" or "module:function", sync or async)
with two perf_counter reads, runs `-m pegaflow.cli ARGS` in this process and,
when it exits, writes per-target call counts and duration percentiles (µs) as
JSON. Each wrapper costs ~1 µs a call, so only nesting of 10 µs and more is
told apart. transfer.py runs its server under it with `--trace-server FILE`.

    python3 benchmarks/phase_trace.py --out trace.json [--target T ...] \
        -m pegaflow.cli --pool-size 4gb ...
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import inspect
import json
import runpy
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # source checkout

# The unix-socket load and save, from the reply down to the copy's wait.
TARGETS = (
    "pegaflow.server.socket_service:_SocketProtocol._answer",
    "pegaflow.server.socket_service:_SocketProtocol._load",
    "pegaflow.server.socket_service:_SocketProtocol._save",
    "pegaflow.server.engine:Engine.load",
    "pegaflow.server.engine:Engine.save",
    "pegaflow.server.copy_dispatch:CopyDispatch.run",
    "pegaflow.server.load_items:l1_transfers",
    "pegaflow.server.engine:Engine._account",
    "pegaflow.copiers.cuda_copier:CudaCopyEngine.scatter",
    "pegaflow.copiers.cuda_copier:CudaCopyEngine.gather",
    "pegaflow.copiers.cuda_copier:CudaCopyEngine._queue",
    "pegaflow.copiers.cuda_copier:CudaCopyEngine._finish",
    "pegaflow.copiers.cuda_copier:CudaCopyEngine.event_done",
    "pegaflow.common.cuda_driver:set_device",
    "pegaflow.copiers.completion:StreamFlag.wait",
    "pegaflow.copiers.dma:plan",
    "pegaflow.kernels.cuda:scatter",
    "pegaflow.kernels.cuda:gather",
    "pegaflow.kernels.cuda:synchronize",
    "pegaflow.kernels.launch_state:StreamTables.next",
    "pegaflow.kernels.device_driver:Stream.launch",
    "pegaflow.kernels.table_jit:checked_table",
    "pegaflow.cache.block_store:BlockStore.reserve_save",
    "pegaflow.cache.block_store:BlockStore.finish_save",
    "pegaflow.common.geometry:KVGeometry.engine_to_slots",
)


class Recorder:
    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}
        self.offcpu: dict[str, list[float]] = {}
        self.threads: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, seconds: float, cpu: float | None = None) -> None:
        with self._lock:
            self.seconds.setdefault(name, []).append(seconds)
            if cpu is not None:
                self.offcpu.setdefault(name, []).append(max(0.0, seconds - cpu))
            self.threads.setdefault(name, set()).add(threading.current_thread().name)

    def summary(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, values in self.seconds.items():
            us = np.asarray(values) * 1e6
            out[name] = {
                "calls": len(us),
                "p50_us": round(float(np.median(us)), 1),
                "p90_us": round(float(np.percentile(us, 90)), 1),
                "mean_us": round(float(us.mean()), 1),
                "min_us": round(float(us.min()), 1),
                "threads": sorted(self.threads[name]),
            }
            if name in self.offcpu:  # sync targets: wall minus the thread's CPU
                off = np.asarray(self.offcpu[name]) * 1e6
                out[name] |= {
                    "offcpu_p50_us": round(float(np.median(off)), 1),
                    "offcpu_p90_us": round(float(np.percentile(off, 90)), 1),
                    "offcpu_share": round(float(off.sum() / max(us.sum(), 1e-9)), 3),
                }
        return out


def timed(fn: Callable[..., Any], name: str, rec: Recorder) -> Callable[..., Any]:
    clock = time.perf_counter
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                rec.add(name, clock() - start)

        return run_async

    # A sync call's time off the CPU (wall minus the calling thread's CPU time,
    # system time included): blocking in the kernel, waiting for a core, or
    # waiting to take the GIL back after a call that dropped it.
    cpu = time.thread_time

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start, start_cpu = clock(), cpu()
        try:
            return fn(*args, **kwargs)
        finally:
            rec.add(name, clock() - start, cpu() - start_cpu)

    return run


def install(targets: list[str], rec: Recorder) -> None:
    for target in targets:
        module_name, _, path = target.partition(":")
        owner: Any = importlib.import_module(module_name)
        *parents, attr = path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        original = inspect.getattr_static(owner, attr)
        if isinstance(original, staticmethod):
            setattr(owner, attr, staticmethod(timed(original.__func__, target, rec)))
        else:
            setattr(owner, attr, timed(original, target, rec))


def show(paths: list[Path]) -> None:
    """One table per trace: the targets by call count, then p50."""
    from benchmarks.common import table

    for path in paths:
        got = json.loads(path.read_text())
        rows = [
            {"target": name.split(":", 1)[1], **{k: v for k, v in r.items()}}
            for name, r in sorted(got.items(), key=lambda kv: -kv[1]["p50_us"])
        ]
        order = ["target", "calls", "mean_us", "min_us", "p50_us", "p90_us"]
        order += ["offcpu_p50_us", "offcpu_p90_us", "offcpu_share", "threads"]
        cols = [c for c in order if any(c in row for row in rows)]
        for row in rows:
            row["threads"] = ",".join(row["threads"])
        for row in rows:  # coroutines have no off-CPU figures
            for c in cols:
                row.setdefault(c, "")
        print(f"\n{path.name}")
        print(table(rows, cols) if rows else "(no calls)")


def python_args(
    profile: str | None,
    trace: str | None,
    targets: tuple[str, ...] = (),
    switch_ms: float | None = None,
) -> tuple[str, ...]:
    """What goes before `-m pegaflow.cli` for a benchmark's server: cProfile
    into `profile`, or this tracer into `trace` (of `targets`, default
    TARGETS; with the GIL switch interval `switch_ms`), or nothing."""
    if profile and trace:
        raise SystemExit("profile and trace the server: choose one")
    if profile:
        return ("-m", "cProfile", "-o", profile)
    if trace:
        extra = [a for t in targets for a in ("--target", t)]
        if switch_ms is not None:
            extra += ["--switch-ms", str(switch_ms)]
        return (str(Path(__file__).resolve()), "--out", trace, *extra)
    return ()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--target", action="append", default=None)
    ap.add_argument("-m", dest="module")
    ap.add_argument("--switch-ms", type=float, help="the GIL switch interval, ms")
    ap.add_argument("--show", type=Path, nargs="+", help="print these traces, exit")
    args, rest = ap.parse_known_args()
    if args.show:
        show(args.show)
        return
    if args.out is None or args.module is None:
        ap.error("--out FILE and -m MODULE are needed to trace a run")
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    rec = Recorder()
    install(args.target or list(TARGETS), rec)

    def write() -> None:
        args.out.write_text(json.dumps(rec.summary(), indent=1, sort_keys=True))

    atexit.register(write)
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
