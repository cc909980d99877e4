"""The GPU half of a start, on threads beside a server that already serves.

Host engines and queries need neither the pinned pool nor the CUDA copy
engine, so neither comes before a (re)started server's first answer; nor
does a CUDA engine wait for the whole pool: pinning all of it
(cudaHostRegister, ~0.1 s a GiB on the H100 host) put a GPU engine's first
hit 10.2 s after the exec at 64 GiB (benchmarks/RESULTS.md, "Warm restart").
The pool is pinned chunk by chunk (pegaflow.cache.pin_chunks) while the
copy kernel is loaded (from pegaflow.kernels.cubin_cache, or compiled by
numba-cuda at an architecture's first start); the CUDA copy engine is
built once those are done and the chunks its construction reads are pinned
(`needs`: the pool's base, whose device alias it takes), and joins the
engine's copiers on the event loop. A CUDA engine's registration waits for
that (`ready`); each copy then waits only for the chunks it touches. A
failure, of the start or of any chunk, is kept, reported by /health as
degraded, and named to every CUDA engine that registers after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pegaflow.cache.pin_chunks import ChunkPins
from pegaflow.common.errors import DeviceBroken

from . import start_clock

logger = logging.getLogger(__name__)

Build = Callable[[ChunkPins], Any]  # the CUDA copy engine, over the pins
FIRST_CHUNK = (0,)  # what CudaCopyEngine() reads: the alias of the pool's base


class CudaBringUp:
    """`pin` (starts the pool's pinning), `warm` (import and compile) and then
    `build` once the `needs` chunks are pinned; `install` gets the built engine
    on the event loop."""

    def __init__(
        self,
        ordinal: int,
        pin: Callable[[], ChunkPins],
        warm: Callable[[], None],
        build: Build,
        install: Callable[[Any], None],
        needs: Sequence[int] = FIRST_CHUNK,
    ) -> None:
        self._ordinal = ordinal  # the first GPU served: /health names it
        self._pin, self._warm, self._build, self._install = pin, warm, build, install
        self._needs = np.asarray(needs, np.int64)
        self._done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        # Set: the rest of the pool may pin once the engine is built. A
        # restart holds it until its check of the kept blocks is done
        # (hold_pins_until_released).
        self._pins_gate = threading.Event()
        self._pins_gate.set()
        self._thread: threading.Thread | None = None
        self._pins: ChunkPins | None = None
        self._stopping = False
        self.seconds: float | None = None  # start -> built, for the log and /health
        self.steps: dict[str, float] = {}  # step -> its end, seconds since exec

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="pegaflow-cuda-bringup", daemon=True
        )
        self._thread.start()

    def run_now(self) -> Any:
        """The whole bring-up on this thread, every chunk pinned first (a start
        that needs the copy engine before it serves: the SSD tier's direct
        route to GPUs)."""
        self._run(None)
        if (exc := self._done.exception()) is not None:
            raise exc
        return self._done.result()

    def _run(self, loop: asyncio.AbstractEventLoop | None) -> None:
        start = time.perf_counter()
        try:
            # Held: only the chunks asked for are pinned while the kernel
            # loads (or numba-cuda compiles it). Pinning takes the mmap lock
            # the compile's allocations need: with the whole pool pinning
            # beside it a GPU engine's registration came 5.2 s (16 GiB) to
            # 10 s (64 GiB) after the exec, growing with the pool (H100).
            pins = self._pins = self._pin()
            with concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pegaflow-cuda-warm"
            ) as side:
                warmed = side.submit(self._step, "kernel loaded", self._warm)
                if loop is None:
                    pins.release()
                    pins.wait_all()
                else:
                    pins.wait(self._needs, None, "the CUDA copy engine's start")
                self._mark("first chunks pinned")
                warmed.result()
            # Built before the rest of the pool pins: its driver calls (streams,
            # the pool's device alias, a warm-up launch) queued behind 8
            # threads' cudaHostRegister of 1 GiB chunks; at 48 GiB a GPU
            # engine registered 3-4 s after the host's first hit (H200).
            engine = self._step("built", lambda: self._build(pins))
        except BaseException as exc:  # kept, and named to CUDA engines
            pinning = None if self._pins is None else self._pins.failure
            cause = pinning or exc  # the cause, not the wait that saw it
            if self._stopping:
                logger.info("CUDA copy engine not started: the server stopped")
            else:
                logger.error("CUDA copy engine not started: %s", cause, exc_info=exc)
            self._done.set_exception(cause)
            return
        self.seconds = time.perf_counter() - start
        logger.info(
            "CUDA copy engine ready in %.2f s (pool chunks pinned: %d of %d); "
            "seconds since exec: %s",
            self.seconds,
            int(pins.pinned.sum()),
            pins.count,
            ", ".join(f"{step} {at:.2f}" for step, at in self.steps.items()),
        )
        if loop is None:
            self._install(engine)
            self._done.set_result(engine)
            return

        def install() -> None:  # on the loop: the copiers map is the loop's
            self._install(engine)
            self._done.set_result(engine)

        try:
            loop.call_soon_threadsafe(install)
        except RuntimeError:  # the loop closed: the server stopped meanwhile
            self._done.set_result(engine)
        self._pins_gate.wait()
        pins.release()

    def hold_pins_until_released(self) -> None:
        """Before start(): after the build, pin only the chunks copies ask
        for until release_pins(). A restart's check of its kept blocks reads
        the pool while the rest of it would pin: beside 8 threads' 1 GiB
        cudaHostRegister calls, a host engine's first hit and a GPU engine's
        registration both waited for the whole pool to pin (3.5 / 7 s
        after the exec at 16 / 48 GiB, H100, 2026-12-06)."""
        self._pins_gate.clear()

    def release_pins(self) -> None:
        """Pin the rest of the pool now (the restart's check is done)."""
        self._pins_gate.set()

    def _step(self, name: str, fn: Callable[[], Any]) -> Any:
        result = fn()
        self._mark(name)
        return result

    def _mark(self, name: str) -> None:
        self.steps[name] = start_clock.since_exec_now()

    async def ready(self) -> None:
        """Once the copy engine serves; DeviceBroken naming the cause if it
        never will (or a chunk of the pool could not be pinned). A cancelled
        wait (the RPC's deadline) leaves it running."""
        try:
            await asyncio.shield(asyncio.wrap_future(self._done))
        except asyncio.CancelledError:
            raise
        except Exception:  # named below
            pass
        if (exc := self._failure()) is not None:
            raise DeviceBroken(
                f"regions: the server's CUDA copy engine failed to start ({exc}); "
                "see the server's log, or restart it with --devices none to serve "
                "host engines only"
            )

    def _failure(self) -> BaseException | None:
        """The start's failure, else the pinning's (which may come later)."""
        if self._done.done() and (exc := self._done.exception()) is not None:
            return exc
        return None if self._pins is None else self._pins.failure

    def engine(self) -> Any | None:
        """The built copy engine; None while starting or after a failed start."""
        if not self._done.done() or self._done.exception() is not None:
            return None
        return self._done.result()

    def state(self) -> str:
        """'starting', 'ready' or 'failed: <why>' (/health)."""
        if (exc := self._failure()) is not None:
            return f"failed: {exc}"
        return "ready" if self._done.done() else "starting"

    def pinning(self) -> dict[str, object] | None:
        """/health's pinning progress: chunks pinned of all; None before it
        started."""
        return None if self._pins is None else self._pins.report()

    @property
    def faults(self) -> dict[int, str]:
        """/health's CUDA faults: the copy engine's, and the start-up's."""
        engine = self.engine()
        faults = {} if engine is None else dict(engine.faults)
        if (exc := self._failure()) is not None:
            faults.setdefault(self._ordinal, f"CUDA start-up: {exc}")
        return faults

    @property
    def mapped_allocations(self) -> int:
        engine = self.engine()
        return 0 if engine is None else engine.mapped_allocations

    def join(self, timeout_s: float | None = None) -> None:
        """Before the pool closes: no chunk is pinned after this returns (the
        ones being pinned finish; the rest are dropped), and the start is
        given `timeout_s` to end."""
        self._stopping = True
        self._pins_gate.set()  # a thread waiting on it ends (stop() pins no more)
        if self._pins is not None:
            self._pins.stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
