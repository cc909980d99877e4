"""Waiting for a socket reply by polling it for a while, with the GIL released.

A client blocked in recv() sleeps, and its CPU may go idle; the server's
reply then waits for the thread to be woken and its core to come back. On
an H100 host (benchmarks/RESULTS.md, session 17) polling 150 us took a
1-block load from 0.331 to 0.288 ms and an event-ordered save from 0.395 to
0.325 (GPU_ENGINE_BUSY_POLL_US below); what a sleeping client costs depends
on the host. Polling in the server's event loop as well gained nothing.

The poll is a compiled loop (numba, nogil) of recv(MSG_PEEK | MSG_DONTWAIT)
calls: a Python loop would hold the GIL between its calls and stall the
engine's other threads (a vLLM worker issues its RPCs from I/O threads while
its main thread runs the forward). It still keeps one core busy for up to the
poll's length on each RPC, so it is off unless asked for (`busy_poll_us`),
and a request whose kind's replies lately took longer than the poll sleeps
until shortly before its reply is due and polls around that time only
(ReplyPoller): a 64-block load (~3 ms) spins for at most twice the poll, not 3 ms.
"""

from __future__ import annotations

import ctypes
import functools
import socket
import time
from typing import Any

import numpy as np

MAX_BUSY_POLL_US = 10_000  # a longer poll is a spinning core, not a latency win
# What a GPU engine's connector polls by default. On an H100 host (2026-12-07,
# benchmarks/RESULTS.md "session 17") it took a 1-block load's P50 from 0.331
# to 0.288 ms and an event-ordered save's from 0.395 to 0.325 (three rounds
# each): a core spins for at most twice this around each reply, as the
# original PegaFlow's engines spin on their load state. A CPU engine polls
# nothing: its cores run the forward.
GPU_ENGINE_BUSY_POLL_US = 150
_PEEK_DONTWAIT = socket.MSG_PEEK | socket.MSG_DONTWAIT
_CLOCK_MONOTONIC = 1  # Linux's clockid
_POLLIN = 1


def check_busy_poll_us(value: object, field: str) -> int:
    """`value` as whole microseconds in [0, MAX_BUSY_POLL_US]; ValueError
    naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected whole microseconds, got {value!r}")
    if not 0 <= value <= MAX_BUSY_POLL_US:
        raise ValueError(f"{field}: must lie in [0, {MAX_BUSY_POLL_US}], got {value}")
    return value


@functools.cache
def _compiled() -> tuple[Any, Any]:
    """The compiled poll and sleep (~0.5 s to compile, once per process)."""
    try:
        from numba import njit
    except ImportError:  # an optional dependency (vLLM installs it)
        raise RuntimeError(
            "busy_poll_us: the poll is compiled with numba, which is not "
            "installed: pip install numba, or set busy_poll_us to 0"
        ) from None

    libc = ctypes.CDLL(None, use_errno=True)
    # Addresses as size_t: the same register as a pointer on every ABI we
    # build for, and what numba passes without casts.
    recv = libc.recv
    recv.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
    recv.restype = ctypes.c_ssize_t
    clock = libc.clock_gettime
    clock.argtypes = (ctypes.c_int, ctypes.c_size_t)
    clock.restype = ctypes.c_int
    # ppoll, not select (fds past 1023 fail there: a vLLM worker holds many)
    # nor poll (whole milliseconds: a 3 ms reply's sleep would overshoot).
    ppoll = libc.ppoll
    ppoll.argtypes = (ctypes.c_size_t, ctypes.c_ulong, ctypes.c_size_t, ctypes.c_size_t)
    ppoll.restype = ctypes.c_int

    @njit(nogil=True)
    def poll(fd: int, spin_ns: int, scratch: np.ndarray) -> bool:
        """True once fd has bytes to read or its peer closed it; False
        after spin_ns without. scratch: int64[3] (a timespec, a peek byte)."""
        at = scratch.ctypes.data
        clock(_CLOCK_MONOTONIC, at)
        end = scratch[0] * 1_000_000_000 + scratch[1] + spin_ns
        while True:
            if recv(fd, at + 16, 1, _PEEK_DONTWAIT) >= 0:  # 0: closed, say so
                return True
            clock(_CLOCK_MONOTONIC, at)
            if scratch[0] * 1_000_000_000 + scratch[1] >= end:
                return False

    @njit(nogil=True)
    def sleep(fd: int, ns: int, scratch: np.ndarray) -> bool:
        """Blocks until fd is readable (True) or ns passed (False; an
        interrupted sleep too). scratch: int64[3] (a timespec, a pollfd)."""
        scratch[0] = ns // 1_000_000_000
        scratch[1] = ns % 1_000_000_000
        scratch[2] = fd | (_POLLIN << 32)  # struct pollfd: fd, events, revents
        at = scratch.ctypes.data
        return ppoll(at + 16, 1, at, 0) > 0

    return poll, sleep


def warm() -> None:
    """Compile the loops now, not in the first RPC that polls."""
    a, b = socket.socketpair()
    with a, b:
        wait_readable(a.fileno(), 1)
        sleep_until_readable(a.fileno(), 1)


def wait_readable(fd: int, spin_ns: int) -> bool:
    """Poll fd for up to spin_ns with the GIL released: True when a recv
    would not block (bytes, or the peer closed). An error on fd (closed,
    not a socket) polls until the time is up; the caller's recv raises it."""
    return bool(_compiled()[0](fd, spin_ns, np.zeros(3, np.int64)))


def sleep_until_readable(fd: int, ns: int) -> bool:
    """Sleep (the GIL released) until fd is readable, at most ns: True
    when it is (or fd is not open: the caller's recv raises that)."""
    return bool(_compiled()[1](fd, ns, np.zeros(3, np.int64)))


class ReplyPoller:
    """Busy polling per kind of request, around the time its reply is due:
    the kind's recent round trip (a moving average, poll included)."""

    __slots__ = ("_ns", "_recent", "on")

    def __init__(self, busy_poll_us: int) -> None:
        self._ns = busy_poll_us * 1000
        self.on = busy_poll_us > 0  # off: callers skip wait() and took()
        self._recent: dict[object, float] = {}  # kind -> round trip, ns

    def wait(self, fd: int, kind: object, sent_ns: int) -> None:
        """Before the blocking recv of a reply to a request of `kind` sent at
        `sent_ns` (time.perf_counter_ns()): polls from the poll's length
        before the reply is due (its kind's recent round trip) to as long
        after it, sleeping until then (woken early if the reply comes). A
        kind seen first is polled for the poll's length."""
        if not self.on:
            return
        due = sent_ns + int(self._recent.get(kind, 0.0))
        now = time.perf_counter_ns()
        if now < due - self._ns:
            if sleep_until_readable(fd, due - self._ns - now):
                return
            now = time.perf_counter_ns()
        if now < due + self._ns:
            wait_readable(fd, due + self._ns - now)

    def took(self, kind: object, ns: int) -> None:
        """A reply to `kind` came `ns` after its request went out. Races
        between threads only blur the average."""
        last = self._recent.get(kind)
        self._recent[kind] = ns if last is None else last + (ns - last) / 8
