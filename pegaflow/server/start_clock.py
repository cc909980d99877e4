"""Where a server start's seconds go, from the process's exec to READY.

A warm restart is only as quick as its slowest step (interpreter and
imports, the GPU probe, the pool file, gRPC), and those differ between hosts
by seconds (benchmarks/RESULTS.md, "Warm restart"). The start marks each step
as it ends; READY carries the total and the log one line with every step, so
an operator (and benchmarks/restart.py) sees which one to look at.

One clock per process: a server process starts once.
"""

from __future__ import annotations

import os
import time

_marks: list[tuple[str, float]] = []


def since_exec() -> float:
    """Seconds since this process was exec'd (the kernel's start time, in
    clock ticks: 10 ms steps); 0.0 where /proc cannot say."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22, counted after the command name, which may hold spaces.
        ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        started = ticks / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


_exec_offset: float | None = None


def since_exec_now() -> float:
    """since_exec(), from one /proc read and the monotonic clock after it
    (finer than the kernel's ticks, and one read per process)."""
    global _exec_offset
    if _exec_offset is None:
        _exec_offset = since_exec() - time.monotonic()
    return _exec_offset + time.monotonic()


def mark(step: str) -> None:
    """`step` ended now."""
    _marks.append((step, since_exec_now()))


def steps() -> dict[str, float]:
    """Each marked step's own seconds, in order; the first counts from exec."""
    out: dict[str, float] = {}
    last = 0.0
    for step, at in _marks:
        out[step] = round(out.get(step, 0.0) + at - last, 3)
        last = at
    return out


def describe() -> str:
    """One log line's worth: "1.84 s since exec: imports 0.61, ..."."""
    parts = ", ".join(f"{step} {s:.2f}" for step, s in steps().items())
    return f"{since_exec_now():.2f} s since exec: {parts}"
