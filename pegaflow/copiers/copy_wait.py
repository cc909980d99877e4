"""Waiting for a GPU batch from the event loop itself, without a copy thread.

On the H200 (benchmarks/RESULTS.md, "sixth session") the server's copier moved
64 blocks as fast as the bare kernel when called on its own thread, and
0.24-0.7 ms slower through a copy thread and the asyncio hand-back: a
sleeping thread's wake-up, twice per copy. So a load or save that needs no
engine event is launched on the loop (its host work is the same Python that
held the GIL on the copy thread) and `settle` waits for it here: the loop
serves other requests on a timer until shortly before the batch should end,
then polls the batch's event between loop iterations.

asyncio's timers wake in whole milliseconds (epoll's resolution; selectors
rounds a timeout up), so the timer covers the whole milliseconds of the wait
and the polling the rest: at most ~1 ms plus EARLY_S of loop iterations that
each query one event. A batch still running POLL_S after its expected end (a
contended GPU, a wrong estimate) is waited for on a thread, as before.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Protocol

EARLY_S = 150e-6  # the timer fires at least this long before the expected end
# ... or this share of the wait: a batch's rate varies by a few percent (a
# 640-block load, 27 ms, ran 2-3 % slower with the loop waking 0.15 ms early
# on an estimate from smaller batches: the H200, sixth session)
EARLY_SHARE = 0.03
POLL_S = 1e-3  # polling past the expected end before handing to a thread
# Which batches are launched here at all (those expected to end within
# measured.LOOP_MAX_S) is the copier's choice: CudaCopyEngine.launch.


class Launched(Protocol):
    """A batch queued on a GPU stream: `expected_end` is time.perf_counter()
    seconds, None where the copier has no rate to estimate it from yet."""

    expected_end: float | None


class LaunchingCopier(Protocol):
    def launch(
        self, direction: str, handle: object, transfers: Any, deadline: float | None
    ) -> Launched | None:
        """The batch queued, or None where it must go by a thread (its stream
        busy with others' batches)."""

    def launched_done(self, launched: Launched) -> bool: ...
    def wait_launched(self, launched: Launched) -> None: ...
    def finish_launched(self, launched: Launched, failed: bool = False) -> None:
        """After it is done, or after waiting for it failed (the copier then
        drains its stream); its resources go back either way."""


async def settle(copier: LaunchingCopier, launched: Launched) -> bool:
    """Until `launched` is done; finish_launched runs whatever happened.
    True: it was waited for on the loop; False: a thread took the wait over."""
    try:
        on_loop = await _until_done(copier, launched)
    except BaseException:
        copier.finish_launched(launched, failed=True)
        raise
    copier.finish_launched(launched)
    return on_loop


def timer_s(remaining_s: float) -> float:
    """How long the loop sleeps on a timer before it polls a batch expected
    to end in `remaining_s`: whole milliseconds (what asyncio's timers can
    do), ending at least max(EARLY_S, EARLY_SHARE of the wait) early."""
    early = max(EARLY_S, EARLY_SHARE * remaining_s)
    return max(0.0, math.floor((remaining_s - early) * 1e3) * 1e-3)


async def _until_done(copier: LaunchingCopier, launched: Launched) -> bool:
    end = launched.expected_end
    if end is None:
        await asyncio.to_thread(copier.wait_launched, launched)
        return False
    timer = timer_s(end - time.perf_counter())
    if timer > 0:
        await asyncio.sleep(timer)
    give_up = end + POLL_S
    while not copier.launched_done(launched):
        if time.perf_counter() >= give_up:
            await asyncio.to_thread(copier.wait_launched, launched)
            return False
        await asyncio.sleep(0)  # one loop iteration: other requests go on
    return True
