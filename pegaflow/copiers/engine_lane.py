"""A host registration's own copy threads, for the copies that reach its
engine's memory through process_vm_readv / process_vm_writev.

Such a copy can wait on the engine for as long as the engine likes: a page of
its registered memory that it remapped to a FUSE file after registering, or
handed to a userfaultfd, faults inside the server's system call until the
engine answers or exits (tests/server/test_stalled_engine.py). Run inline on
the event loop, that stopped every engine; on a shared thread pool, each such
request took a thread every other engine needed, and a few took them all.

A lane confines the wait to its own registration: one runner thread takes
the registration's copies in order, `helpers` threads copy their parallel
parts (they never queue work of their own, so a copy never waits on its own
lane), and only this registration's copies ever queue behind a stalled one.
The dispatcher (pegaflow.server.copy_dispatch) lets one copy at a time hold
the runner and at most MAX_WAITING more wait for it; further ones are
refused at once (Overloaded), so a stalled engine holds a bounded number of
RPCs. Daemon threads: a runner stuck until its engine exits never holds up
the server's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

MAX_WAITING = 8  # copies of one registration queued behind the running one

_STOP = object()


class Threads:
    """A few daemon threads taking submitted calls in order; `submit` as
    concurrent.futures.Executor's (what run_copy and the host copier call)."""

    def __init__(self, count: int, name: str) -> None:
        self._count, self._name = count, name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: closed")
            if len(self._threads) < self._count:  # started as work first comes
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}-{len(self._threads)}",
                    daemon=True,
                )  # fmt: skip
                self._threads.append(thread)
                thread.start()
            self._work.put((future, fn, args, kwargs))
        return future

    def owns_current_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def _serve(self) -> None:
        while (item := self._work.get()) is not _STOP:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to whoever waits on it
                future.set_exception(exc)

    def close(self) -> None:
        """Threads end once the work queued before this is done; never waits
        (one may be stuck in its engine's memory until that engine exits)."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._work.put(_STOP)


class EngineLane:
    """One registration's runner and its copies' helper threads."""

    def __init__(self, name: str, helpers: int) -> None:
        self.runner = Threads(1, f"{name}-copy")
        self.helpers = Threads(helpers, f"{name}-part") if helpers > 0 else None
        self.waiting = 0  # copies admitted by the dispatcher, not yet ended
        self.turn: Any = None  # the dispatcher's asyncio.Lock, made on its loop

    def close(self) -> None:
        self.runner.close()
        if self.helpers is not None:
            self.helpers.close()
