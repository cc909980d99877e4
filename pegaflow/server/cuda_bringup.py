"""The GPU half of a start, on threads beside a server that already serves.

Host engines and queries need neither the pinned pool nor the CUDA copy
engine, yet both used to come before a (re)started server's first answer: on
the H200 host pinning a kept 16 GiB pool file (cudaHostRegister, which faults
in and pins every page) took ~2 s and importing numba-cuda and compiling the
copy kernel ~3 s more (benchmarks/RESULTS.md, "Warm restart"). Here the pool
is pinned on one thread while the kernel compiles on another; the CUDA copy
engine is built once both are done, and joins the engine's copiers on the
event loop. A CUDA engine's registration waits for that (`ready`); a failure
is kept, reported by /health as degraded, and named to every CUDA engine that
registers after it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pegaflow.common.errors import DeviceBroken

logger = logging.getLogger(__name__)

Build = Callable[[], Any]  # the CUDA copy engine, once the pool is pinned


class CudaBringUp:
    """`pin` (the pool's registration), `warm` (import and compile) and then
    `build`; `install` gets the built engine on the event loop."""

    def __init__(
        self,
        ordinal: int,
        pin: Callable[[], None],
        warm: Callable[[], None],
        build: Build,
        install: Callable[[Any], None],
    ) -> None:
        self._ordinal = ordinal  # the first GPU served: /health names it
        self._pin, self._warm, self._build, self._install = pin, warm, build, install
        self._done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._thread: threading.Thread | None = None
        self.seconds: float | None = None  # start -> built, for the log and /health

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name="pegaflow-cuda-bringup", daemon=True
        )
        self._thread.start()

    def run_now(self) -> Any:
        """The whole bring-up on this thread (a start that needs the copy
        engine before it serves: the SSD tier's direct route to GPUs)."""
        self._run(None)
        if (exc := self._done.exception()) is not None:
            raise exc
        return self._done.result()

    def _run(self, loop: asyncio.AbstractEventLoop | None) -> None:
        start = time.perf_counter()
        try:
            with concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pegaflow-cuda-warm"
            ) as side:
                warmed = side.submit(self._warm)
                self._pin()
                warmed.result()
            engine = self._build()
        except BaseException as exc:  # kept, and named to CUDA engines
            logger.error("CUDA copy engine failed to start: %s", exc, exc_info=True)
            self._done.set_exception(exc)
            return
        self.seconds = time.perf_counter() - start
        logger.info("CUDA copy engine ready in %.2f s", self.seconds)
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

    async def ready(self) -> None:
        """Once the copy engine serves; DeviceBroken naming the cause if it
        never will. A cancelled wait (the RPC's deadline) leaves it running."""
        try:
            await asyncio.shield(asyncio.wrap_future(self._done))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DeviceBroken(
                f"regions: the server's CUDA copy engine failed to start ({exc}); "
                "see the server's log, or restart it with --devices none to serve "
                "host engines only"
            ) from None

    def engine(self) -> Any | None:
        """The built copy engine; None while starting or after a failure."""
        if not self._done.done() or self._done.exception() is not None:
            return None
        return self._done.result()

    def state(self) -> str:
        """'starting', 'ready' or 'failed: <why>' (/health)."""
        if not self._done.done():
            return "starting"
        exc = self._done.exception()
        return "ready" if exc is None else f"failed: {exc}"

    @property
    def faults(self) -> dict[int, str]:
        """/health's CUDA faults: the copy engine's, or the start-up's."""
        engine = self.engine()
        if engine is not None:
            return engine.faults
        if not self._done.done():
            return {}
        return {self._ordinal: f"CUDA start-up: {self._done.exception()}"}

    @property
    def mapped_allocations(self) -> int:
        engine = self.engine()
        return 0 if engine is None else engine.mapped_allocations

    def join(self, timeout_s: float | None = None) -> None:
        """Before the pool closes: it must not be unpinned mid-registration."""
        if self._thread is not None:
            self._thread.join(timeout_s)
