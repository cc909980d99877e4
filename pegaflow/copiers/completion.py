"""How the copy thread learns that a batch it queued on a stream is done.

Two ways, chosen per batch with its copy path (pegaflow.copiers.measured.COMPLETION):

- a stream synchronize: blocks without the GIL, and a fault in the copy
  surfaces there;
- a `StreamFlag`: the stream writes a sequence number into a word of mapped
  pinned host memory (cuStreamWriteValue32, after a memory fence and every copy
  queued before it) and the host polls that word. For copy-engine batches of
  one block this saved 37 us on the H200 (2026-12-02, save P50 112 vs 149 us
  with a stream synchronize): the driver's blocking wait wakes the thread
  later than a poll sees the word.

A flag wait reads the word without a syscall for its first HOT_S (a 1-block
batch ends within it), then polls up to `spin_s`, yielding the GIL between
reads (a copy thread must not starve the event loop), then falls back to the
stream synchronize. Those yields are `time.sleep(0)`, which sleeps the
kernel's timer slack (50 us) each: with them from the first read a 1-block
save's flag wait was 70 us P50 on the H200, 49 of them asleep; read hot, 34
(benchmarks/RESULTS.md, "ninth session"; a 1 us timer slack instead did as
well for the wait, and slowed the rest of the save). The synchronize is the
end because a stalled or failed stream never writes the word, and its error
surfaces there. Several threads may share a stream: sequence
numbers are taken and their writes queued under one lock, so the word only
grows in stream order and a waiter is done once it reached its own number.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import numpy as np

from pegaflow.common import cuda_driver
from pegaflow.common.errors import CopyFailed

SPIN_S = 2e-3  # ~10x a small batch; longer waits block in the synchronize
# Read without a syscall first: a 1-block batch ends in ~35 us. It holds the
# GIL that long at most, a fiftieth of the switch interval.
HOT_S = 100e-6
MASK = 0xFFFFFFFF
HALF = 1 << 31

Write = Callable[[int, int, int], None]  # (stream handle, device address, value)


def reached(word: int, seq: int) -> bool:
    """`word` is `seq` or a later number (modulo 2**32)."""
    return (word - seq) & MASK < HALF


class StreamFlag:
    """One word that a stream writes and the host polls."""

    def __init__(
        self,
        host_address: int,
        device_address: int,
        write: Write,
        spin_s: float = SPIN_S,
    ) -> None:
        word = (ctypes.c_uint32 * 1).from_address(host_address)
        self._word = np.ctypeslib.as_array(word)
        self._device = device_address
        self._write = write
        self._spin = spin_s
        self._seq = int(self._word[0])
        self._lock = threading.Lock()

    def wait(self, stream: int, synchronize: Callable[[], None]) -> bool:
        """Until the work queued on `stream` before this call is done. True
        when the flag said so, False when it fell back to `synchronize`."""
        with self._lock:
            seq = self._seq = (self._seq + 1) & MASK
            self._write(stream, self._device, seq)
        word = self._word
        now = time.perf_counter()
        hot_until, give_up = now + HOT_S, now + self._spin
        while not reached(int(word[0]), seq):
            now = time.perf_counter()
            if now > give_up:
                synchronize()
                return False
            if now > hot_until:
                time.sleep(0)  # lets other threads take the GIL between reads
        return True


ENGINE_SPIN_S = 1e-3  # poll an engine's event without sleeping for this long
ENGINE_POLL_S = 50e-6


def wait_engine_event(event: object, timeout_s: float) -> None:
    """Until an engine's interprocess event completed (a save waits for the
    step that wrote its KV), at most timeout_s: CopyFailed past it."""
    start = time.monotonic()
    while not cuda_driver.event_done(event):
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise CopyFailed(
                f"wait_event: the engine's event did not complete within "
                f"{timeout_s:g} s (engine gone mid-step?)"
            )
        time.sleep(0 if waited < ENGINE_SPIN_S else ENGINE_POLL_S)
