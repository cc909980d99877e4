"""The worker's I/O threads, kept off the core its forward pass is pinned to.

vLLM's CPU worker binds each OpenMP thread to one core (the main thread to the
first), and a thread inherits its creator's CPU mask: the connector's I/O
threads would all share the main thread's core with the forward pass, and an
RPC's reply would wait for that core. They may run on any CPU the engine's own
threads were given -- the union of their masks -- which never widens what an
operator allowed the process (taskset, a cpuset, a NUMA binding).
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


def engine_cpus() -> set[int]:
    """The CPUs any thread of this process may run on now."""
    cpus: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):  # a thread that just ended
            cpus |= os.sched_getaffinity(int(tid))
    return cpus or os.sched_getaffinity(0)


def io_pool(threads: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads may use every CPU of the engine's threads."""
    cpus = engine_cpus()

    def widen() -> None:
        if os.sched_getaffinity(0) >= cpus:
            return
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:  # a cpuset shrank meanwhile: keep the inherited
            logger.debug("pegaflow I/O thread keeps its CPU mask: %s", exc)

    return ThreadPoolExecutor(threads, name, initializer=widen)
