"""Deadlines on this host's CLOCK_MONOTONIC, shared by the engine and the server.

A request that moves bytes carries the engine's deadline as monotonic
nanoseconds: engines that save or load share the server's host, so both read the
same clock (unless a time namespace separates them: then a deadline reads as far
off or long past, and the request is refused with a message saying so). Unlike a
relative timeout, an absolute deadline cannot be renewed by a frame that waited in
a socket buffer while the server was stopped.
"""

from __future__ import annotations

import time

from .errors import DeadlineExceeded, InvalidRequest

# A deadline further ahead than this is not one of ours: another clock.
MAX_AHEAD_S = 3600.0


def to_wire(timeout_s: float) -> int:
    """The deadline `timeout_s` from now, as a request carries it."""
    return time.monotonic_ns() + int(timeout_s * 1e9)


def from_wire(deadline_ns: int, field: str = "deadline_ns") -> float | None:
    """time.monotonic() seconds, or None for 0 (no deadline of its own)."""
    if not deadline_ns:
        return None
    deadline = deadline_ns / 1e9
    ahead = deadline - time.monotonic()
    if ahead > MAX_AHEAD_S:
        raise InvalidRequest(
            f"{field}: {ahead:.0f} s ahead of this host's monotonic clock; the "
            "engine must run on this host, in the server's time namespace"
        )
    return deadline


def earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def check(deadline: float | None, what: str) -> None:
    """Raise DeadlineExceeded when the deadline has passed: no work starts then."""
    if deadline is not None and time.monotonic() >= deadline:
        late = time.monotonic() - deadline
        raise DeadlineExceeded(
            f"{what}: the request's deadline passed {late * 1e3:.0f} ms ago; "
            "nothing was copied"
        )
