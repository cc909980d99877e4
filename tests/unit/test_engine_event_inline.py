"""An event-gated Save whose event already completed copies inline, without
the wait; one whose event is pending still waits on a copy thread."""

from __future__ import annotations

import threading

import pytest

from pegaflow.common.errors import InvalidRequest
from pegaflow.common.geometry import Transfers
from tests.unit.host_engine import host_engine, save_two_blocks


class EventCopier:
    """Stand-in for the CUDA copier: an event that is done or not, and a log
    of (thread, wait_event) per gather."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.gathers: list[tuple[str, int]] = []

    def open(self, pid: int, regions: list, cuda: object = None) -> object:
        return object()

    def event_done(self, handle: object, wait_event: int) -> bool:
        if wait_event != 1:
            raise InvalidRequest(f"wait_event: {wait_event}, 1 event registered")
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


def test_a_bad_event_index_fails_the_save_before_any_copy() -> None:
    copier = EventCopier(done=True)
    with pytest.raises(InvalidRequest, match="wait_event"):
        _save(copier, 2)
    assert copier.gathers == []
