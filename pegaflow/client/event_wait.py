"""Waiting for a load answered in flight (PegaflowClient.load's done_event):
until the IPC event the server recorded after the copy completed.

The wait sleeps until shortly before the copy should end, then polls the
event in a compiled loop that holds no GIL (a vLLM worker's forward runs in
another thread, and a Python loop handing the GIL back and forth could be
late by a whole switch interval). When it should end comes from the recent
loads of its size class (a faster one counts at once, a slower one by half),
learnt only from waits that woke before their copy ended: one that found its
copy already done overslept by an unknown time, and only says to wake earlier
(a wait's own oversleep must never teach it to sleep longer: on an H100 host
that feedback took 64-block loads from 3.4 to 4.2 ms, session 17). A class's
first copy may be slow (its first launch): the wait after it polls from the
start too, so that one copy's time is not what the next ~20 loads of the
class sleep on, waking 1.25x earlier each (4 contiguous blocks, the first
of their class in a run, loaded at 2.3-3.3 GB/s against 14-20 random, H100,
session 22). Re-timing after every oversleep instead cost 64 random blocks
~3 % (same session).

A copy that fails never records its event, nor does one whose server died:
the wait also watches the connection the load went out on, which the server
ends when such a copy fails (pegaflow.server.in_flight) and the kernel ends
when the server dies, and fails within WATCH_S of that instead of waiting out
its timeout.
"""

from __future__ import annotations

import ctypes
import functools
import select
import time
from typing import Any

import numpy as np

from pegaflow.common import cuda_driver
from pegaflow.common.errors import CopyFailed

LIBCUDA = "libcuda.so.1"
NOT_READY = 600  # CUDA_ERROR_NOT_READY
_CLOCK_MONOTONIC = 1  # Linux's clockid
WAKE_EARLY_S = 200e-6  # a sleeping thread wakes tens to hundreds of us late
EARLIER = 1.25  # an overslept wait's class: assume it this much faster
WATCH_S = 1e-3  # the connection is looked at between polls this often


@functools.cache
def _spin() -> Any:
    """spin(event, until_ns, scratch) -> the last cuEventQuery result: polls
    until it is not NOT_READY or CLOCK_MONOTONIC reaches until_ns; None
    without numba (a Python loop polls instead)."""
    try:
        from numba import njit
    except ImportError:
        return None
    query = ctypes.CDLL(LIBCUDA).cuEventQuery
    query.argtypes, query.restype = (ctypes.c_size_t,), ctypes.c_int
    clock = ctypes.CDLL(None).clock_gettime
    clock.argtypes, clock.restype = (ctypes.c_int, ctypes.c_size_t), ctypes.c_int

    @njit(nogil=True)
    def spin(event: int, until_ns: int, scratch: np.ndarray) -> int:
        at = scratch.ctypes.data
        while True:
            got = query(event)
            if got != NOT_READY:
                return got
            clock(_CLOCK_MONOTONIC, at)
            if scratch[0] * 1_000_000_000 + scratch[1] >= until_ns:
                return got

    return spin


class LoadWaits:
    """One worker's waits for its loads answered in flight."""

    def __init__(self) -> None:
        self._rates: dict[int, float] = {}  # size class -> bytes/s, send to done
        self._second: set[int] = set()  # classes timed once: the next polls throughout

    def wait(self, event: Any, index: int, timeout_s: float, nbytes: int,
             sent_at: float, hang_up_fd: int = -1) -> None:  # fmt: skip
        """Until `event` (the load's done_event `index`) completed: the copy
        landed. sent_at: time.monotonic() as the load went out; hang_up_fd:
        the connection it went out on (-1: none to watch). CopyFailed when the
        event fails (the server's copy faulted), when that connection ends
        first, or when it does not complete within timeout_s."""
        size = nbytes.bit_length()
        rate = self._rates.get(size)
        watch = _Watch(hang_up_fd, index)
        probe = size in self._second
        self._second.discard(size)
        if rate and not probe:
            nap = sent_at + nbytes / rate - WAKE_EARLY_S - time.monotonic()
            if nap > 0:
                watch.nap(nap)
        try:  # one look through the runtime (it makes the thread's context)
            done_at_first = cuda_driver.event_done(event)
        except cuda_driver.CudaError as exc:
            raise CopyFailed(f"done_event: {index}: {exc}") from exc
        if not done_at_first:
            self._poll(event, index, timeout_s, sent_at, watch)
        took = time.monotonic() - sent_at
        if done_at_first and rate and not probe:  # overslept: by how much, unknown
            self._rates[size] = rate * EARLIER
        elif took > 0:  # waking early costs a spin, late the load: lean fast
            got = nbytes / took
            if rate is None:
                self._second.add(size)
            self._rates[size] = got if rate is None else max(got, (rate + got) / 2)

    @staticmethod
    def _poll(event: Any, index: int, timeout_s: float, sent_at: float,
              watch: _Watch) -> None:  # fmt: skip
        until = sent_at + timeout_s
        spin = _spin()
        scratch = np.zeros(2, np.int64)
        while (now := time.monotonic()) < until:
            if spin is not None:  # monotonic clocks agree (CLOCK_MONOTONIC)
                step = min(until, now + WATCH_S) if watch.on else until
                got = spin(int(event), int(step * 1e9), scratch)
                if got == 0:
                    return
                if got != NOT_READY:
                    raise CopyFailed(f"done_event: {index}: cuEventQuery error {got}")
            elif cuda_driver.event_done(event):
                return
            else:
                time.sleep(0)
            if watch.ended() and not cuda_driver.event_done(event):
                watch.fail()
        raise CopyFailed(
            f"done_event: {index} did not complete within {timeout_s:g} s (the "
            "server stopped mid-copy?); the blocks may hold anything"
        )


class _Watch:
    """The connection a load went out on: the server sends nothing on it
    until the next request, so anything to read there (its end, as a rule)
    means the copy will not be answered. poll, not select: a vLLM worker's
    descriptors run past select's 1,024."""

    def __init__(self, fd: int, index: int) -> None:
        self.on, self._index = fd >= 0, index
        self._poll = select.poll()
        if self.on:
            self._poll.register(fd, select.POLLIN)  # (ends and errors: always)

    def ended(self) -> bool:
        return self.on and bool(self._poll.poll(0))

    def nap(self, seconds: float) -> None:
        """Sleep `seconds`, less if the connection ends meanwhile: whole ms
        watched (poll's resolution), the rest slept (a rate learnt from a
        stalled wait may ask for a long nap)."""
        end = time.monotonic() + seconds
        if self.on and seconds >= 1e-3 and self._poll.poll(int(seconds * 1e3)):
            return
        if (left := end - time.monotonic()) > 0:
            time.sleep(left)

    def fail(self) -> None:
        raise CopyFailed(
            f"done_event: {self._index}: the server ended the connection before "
            "the copy landed (the copy failed, or the server stopped); the "
            "blocks may hold anything"
        )
