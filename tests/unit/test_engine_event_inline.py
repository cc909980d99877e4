"""An event-gated Save whose event already completed, or completes within a
few loop iterations (copy_wait.EVENT_POLL_S), copies inline, without the
wait; one whose event stays pending still waits on a copy thread."""

from __future__ import annotations

import threading
import time

import pytest

from pegaflow.errors import InvalidRequest
from pegaflow.geometry import Transfers
from tests.unit.host_engine import host_engine, save_two_blocks


class EventCopier:
    """Stand-in for the CUDA copier: an event that is done or not, and a log
    of (thread, wait_event) per gather."""

    def __init__(self, done: bool, done_after: int | None = None) -> None:
        self.done = done
        self.done_after = done_after  # queries until it completes, if set
        self.queries = 0
        self.gathers: list[tuple[str, int]] = []

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        if wait_event != 1:
            raise InvalidRequest(f"wait_event: {wait_event}, 1 event registered")
        self.queries += 1
        if self.done_after is not None and self.queries > self.done_after:
            self.done = True
        return self.done

    def gather(
        self,
        handle: object,
        t: Transfers,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None:
        self.gathers.append((threading.current_thread().name, wait_event))

    def scatter(
        self, handle: object, t: Transfers, deadline: float | None = None
    ) -> None:
        raise AssertionError("not used")

    def close(self, handle: object) -> None:
        pass


def _save(copier: EventCopier, wait_event: int) -> object:
    return save_two_blocks(host_engine(copier), wait_event)


def test_a_completed_event_copies_inline_without_waiting() -> None:
    copier = EventCopier(done=True)
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    assert copier.gathers == [("MainThread", 0)]


def test_a_pending_event_waits_on_a_copy_thread() -> None:
    copier = EventCopier(done=False)
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    [(thread, wait_event)] = copier.gathers
    assert thread != "MainThread" and wait_event == 1


def test_an_event_completing_within_a_few_loop_iterations_copies_inline() -> None:
    """On the H200 an event recorded just before its save was often not done
    at the first query: that save paid a copy thread's hand-off (~0.2-0.5 ms)
    for a wait of µs."""
    copier = EventCopier(done=False, done_after=3)
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    assert copier.gathers == [("MainThread", 0)]
    assert copier.queries == 4


def test_a_pending_event_is_polled_briefly_then_left_to_a_thread() -> None:
    copier = EventCopier(done=False)
    start = time.perf_counter()
    assert _save(copier, 1).stored == 2  # type: ignore[attr-defined]
    assert copier.queries >= 2  # polled, not only asked once
    [(thread, _)] = copier.gathers
    assert thread != "MainThread"
    assert time.perf_counter() - start < 2.0  # bounded (EVENT_POLL_S, then the copy)


def test_a_bad_event_index_fails_the_save_before_any_copy() -> None:
    copier = EventCopier(done=True)
    with pytest.raises(InvalidRequest, match="wait_event"):
        _save(copier, 2)
    assert copier.gathers == []
