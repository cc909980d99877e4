"""Waiting for loads answered in flight (pegaflow.client.event_wait) over
stand-ins for the CUDA event calls: when a wait sleeps, what it learns, and
how a failed or lost event ends it."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import pytest

from pegaflow.client import event_wait
from pegaflow.common import cuda_driver
from pegaflow.common.errors import CopyFailed

MB = 1 << 20


class Copy:
    """A copy that lands `ends_after` seconds after it was sent."""

    def __init__(self, monkeypatch, ends_after: float, error: int = 0) -> None:
        self.sent = time.monotonic()
        self.ends_after, self.error = ends_after, error
        self.looks: list[float] = []
        monkeypatch.setattr(cuda_driver, "event_done", self.done)
        monkeypatch.setattr(event_wait, "_spin", lambda: self.spin)

    def done(self, event: object) -> bool:
        self.looks.append(time.monotonic() - self.sent)
        return time.monotonic() - self.sent >= self.ends_after

    def spin(self, event: int, until_ns: int, scratch: object) -> int:
        while time.monotonic_ns() < until_ns:
            if self.error:
                return self.error
            if time.monotonic() - self.sent >= self.ends_after:
                return 0
            time.sleep(0)  # the real spin holds no GIL: other threads run
        return event_wait.NOT_READY


def test_a_wait_learns_from_copies_it_saw_end_and_wakes_earlier_after_oversleeping(
    monkeypatch,
) -> None:
    waits = event_wait.LoadWaits()
    first = Copy(monkeypatch, 0.02)
    waits.wait(1, 1, 5.0, 64 * MB, first.sent)  # no rate yet: polls at once
    assert first.looks[0] < 0.015  # (a loaded machine may be slow to get here)
    rate = waits._rates[(64 * MB).bit_length()]
    assert 64 * MB / 0.05 < rate <= 64 * MB / 0.02
    second = Copy(monkeypatch, 0.02)  # timed once: the first may have been slow
    waits.wait(1, 1, 5.0, 64 * MB, second.sent)
    assert second.looks[0] < 0.015
    third = Copy(monkeypatch, 0.02)
    waits.wait(1, 1, 5.0, 64 * MB, third.sent)  # sleeps most of it, then polls
    assert third.looks[0] > 0.01  # it slept most of the copy first
    before = waits._rates[(64 * MB).bit_length()]
    slow = Copy(monkeypatch, 0.2)  # seen to end, 10x slower: counts by half
    waits.wait(1, 1, 5.0, 64 * MB, slow.sent)
    after = waits._rates[(64 * MB).bit_length()]
    assert (before + 64 * MB / 0.25) / 2 <= after <= (before + 64 * MB / 0.2) / 2
    fast = Copy(monkeypatch, 0.0)  # done long before the wait looks: overslept
    learnt = waits._rates[(64 * MB).bit_length()]
    waits.wait(1, 1, 5.0, 64 * MB, fast.sent)
    assert waits._rates[(64 * MB).bit_length()] == learnt * event_wait.EARLIER
    waits.wait(1, 1, 5.0, MB, Copy(monkeypatch, 0.001).sent)  # its own class
    assert len(waits._rates) == 2


def test_a_slow_first_copy_holds_back_no_load_after_it(monkeypatch) -> None:
    """A size class's first copy was slow (its first launch): the loads after
    it are fast. Each woke 1.25x earlier than the last, so ~20 of them slept
    most of the slow one's time (H100, session 22: 4 contiguous blocks, the
    first of their class in a run, at 2.3-3.3 GB/s against 14-20 random)."""
    waits = event_wait.LoadWaits()
    waits.wait(1, 1, 5.0, 8 * MB, Copy(monkeypatch, 0.1).sent)  # slow, seen to end
    took = []
    for _ in range(5):
        copy = Copy(monkeypatch, 0.002)
        waits.wait(1, 1, 5.0, 8 * MB, copy.sent)
        took.append(time.monotonic() - copy.sent)
    assert max(took) < 0.03, took  # before: 0.1, 0.08, 0.064, ...


def test_a_failed_or_lost_event_fails_the_wait_naming_done_event(monkeypatch) -> None:
    waits = event_wait.LoadWaits()
    lost = Copy(monkeypatch, 10.0)  # its server died: never recorded
    with pytest.raises(CopyFailed, match="done_event: 3 did not complete within"):
        waits.wait(1, 3, 0.05, MB, lost.sent)
    faulted = Copy(monkeypatch, 10.0, error=700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CopyFailed, match="done_event: 2: cuEventQuery error 700"):
        waits.wait(1, 2, 5.0, MB, faulted.sent)


def ended(server_end: socket.socket) -> None:
    """The server's end closed (shut down first: a descriptor copy a fork
    elsewhere in this process might hold would keep close() from ending it)."""
    server_end.shutdown(socket.SHUT_RDWR)
    server_end.close()


def test_a_wait_fails_soon_after_its_connection_ends_and_not_while_it_stays(
    monkeypatch,
) -> None:
    """The server ends the load's connection when its copy fails after the
    answer (pegaflow.server.in_flight), and the kernel ends it when the server
    dies: either way the event is never recorded, and the wait must not sit
    out its timeout."""
    waits = event_wait.LoadWaits()
    engine_end, server_end = socket.socketpair()
    with engine_end, server_end:
        for _ in range(2):  # the first two waits of a size class poll throughout
            lands = Copy(monkeypatch, 0.03)  # the connection stays: it lands
            waits.wait(1, 1, 5.0, MB, lands.sent, engine_end.fileno())
            assert time.monotonic() - lands.sent >= 0.03
        # A rate learnt from a stalled wait: the wait would nap 3 s first.
        waits._rates[MB.bit_length()] = MB / 3.0
        lost = Copy(monkeypatch, 60.0)
        hang_up = threading.Timer(0.05, ended, (server_end,))
        hang_up.start()
        with pytest.raises(CopyFailed, match="done_event: 4: the server ended"):
            waits.wait(1, 4, 30.0, MB, lost.sent, engine_end.fileno())
        hang_up.join()
        took = time.monotonic() - lost.sent
        assert 0.05 <= took < 2.5, took  # not the nap, nor the 30 s timeout
        # Landed before the wait looked (the server stopped after it): the
        # blocks are there, whatever the connection says now.
        waits.wait(1, 2, 5.0, MB, Copy(monkeypatch, 0.0).sent, engine_end.fileno())


def test_a_connection_numbered_past_selects_limit_is_watched_too(monkeypatch) -> None:
    """A vLLM worker holds well over 1,024 descriptors: select() cannot take
    them, poll() can."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1500:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    engine_end, server_end = socket.socketpair()
    try:
        high = os.dup2(engine_end.fileno(), 1500)
        ended(server_end)  # the server died before the wait looked
        with pytest.raises(CopyFailed, match="the server ended the connection"):
            event_wait.LoadWaits().wait(
                1, 1, 30.0, MB, Copy(monkeypatch, 60.0).sent, high
            )
        os.close(high)
    finally:
        engine_end.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
