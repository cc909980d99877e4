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
that feedback took 64-block loads from 3.4 to 4.2 ms, session 17).
"""

from __future__ import annotations

import ctypes
import functools
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

    def wait(self, event: Any, index: int, timeout_s: float, nbytes: int,
             sent_at: float) -> None:  # fmt: skip
        """Until `event` (the load's done_event `index`) completed: the copy
        landed. sent_at: time.monotonic() as the load went out. CopyFailed
        when the event fails (the server's copy faulted) or does not complete
        within timeout_s (its server gone mid-copy: the record never ran)."""
        size = nbytes.bit_length()
        rate = self._rates.get(size)
        if rate:
            nap = sent_at + nbytes / rate - WAKE_EARLY_S - time.monotonic()
            if nap > 0:
                time.sleep(nap)
        try:  # one look through the runtime (it makes the thread's context)
            done_at_first = cuda_driver.event_done(event)
        except cuda_driver.CudaError as exc:
            raise CopyFailed(f"done_event: {index}: {exc}") from exc
        if not done_at_first:
            self._poll(event, index, timeout_s, sent_at)
        took = time.monotonic() - sent_at
        if done_at_first and rate:  # overslept: by how much, unknown
            self._rates[size] = rate * EARLIER
        elif took > 0:  # waking early costs a spin, late the load: lean fast
            got = nbytes / took
            self._rates[size] = got if rate is None else max(got, (rate + got) / 2)

    @staticmethod
    def _poll(event: Any, index: int, timeout_s: float, sent_at: float) -> None:
        until = sent_at + timeout_s
        spin = _spin()
        if spin is not None:
            until_ns = int(until * 1e9)  # monotonic clocks agree (CLOCK_MONOTONIC)
            got = spin(int(event), until_ns, np.zeros(2, np.int64))
            if got == 0:
                return
            if got != NOT_READY:
                raise CopyFailed(f"done_event: {index}: cuEventQuery error {got}")
        else:
            while time.monotonic() < until:
                if cuda_driver.event_done(event):
                    return
                time.sleep(0)
        raise CopyFailed(
            f"done_event: {index} did not complete within {timeout_s:g} s (the "
            "server stopped mid-copy?); the blocks may hold anything"
        )
