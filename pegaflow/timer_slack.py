"""The server's timer slack: how late the kernel may wake a sleeping thread.

Linux lets a sleep or a timed wait end up to the thread's timer slack late
(50 us by default) so that wake-ups coalesce. The server's short waits are
measured in microseconds: a copy thread or the event loop polls a GPU batch
with `time.sleep(0)` between reads (pegaflow.copiers.completion; it sleeps
rather than spins so the GIL passes to other threads), and each of those
polls slept the whole 50 us: on the H200 a 1-block save's flag wait was 68 us
P50, 49 of them off the CPU (benchmarks/RESULTS.md, "ninth session"). A
sleep(0) on the dev VM: 87 us at the default slack, 16 us at 1 us.

Set once at start-up, before the server starts threads: the slack is per
thread, and a thread starts with its creator's.
"""

from __future__ import annotations

import ctypes
import logging
import sys

SERVER_SLACK_NS = 1_000
_PR_SET_TIMERSLACK = 29  # <linux/prctl.h>

logger = logging.getLogger(__name__)


def tighten(slack_ns: int = SERVER_SLACK_NS) -> bool:
    """Sets the calling thread's timer slack; False where the kernel would
    not (not Linux, a seccomp filter): the server runs as before."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(slack_ns), 0, 0, 0) != 0:
        logger.debug("prctl(PR_SET_TIMERSLACK) failed: errno %d", ctypes.get_errno())
        return False
    return True
