"""The advertiser thread against a stand-in metaserver client: which errors
make it join again (only "unknown incarnation"), what a failed batch becomes
(tried again, then dropped and counted), heartbeats under a steady stream of
saves, and withdrawals before advertisements on a full queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest

from pegaflow.tiers.remote import advertiser as adv
from pegaflow.tiers.remote.advertiser import Advertiser

NS = b"d" * 16


@dataclass(frozen=True)
class Terms:
    heartbeat_interval_s: float = 5.0
    ttl_s: float = 600.0
    max_batch_hashes: int = 4096


class Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


UNKNOWN = Err(
    grpc.StatusCode.FAILED_PRECONDITION,
    "node: unknown incarnation (node 'a' has not joined)",  # as nodes.py says it
)


class FakeClient:
    addr = "fake"

    def __init__(self, terms: Terms) -> None:
        self.terms = terms
        self.lock = threading.Lock()
        self.joins = self.heartbeats = 0
        self.inserted: list[bytes] = []
        self.removed: list[bytes] = []
        # op -> raises before it answers (None: answer); consumed one a call.
        self.faults: dict[str, list[grpc.RpcError]] = {"insert": [], "remove": []}
        self.insert_delay_s = 0.0

    def _fault(self, op: str) -> None:
        with self.lock:
            if self.faults[op]:
                raise self.faults[op].pop(0)

    def join(self, endpoint: str) -> Terms:
        with self.lock:
            self.joins += 1
        return self.terms

    def heartbeat(self) -> int:
        with self.lock:
            self.heartbeats += 1
        return 0

    def insert(self, digest: bytes, hashes: list[bytes]) -> tuple[int, int]:
        self._fault("insert")
        time.sleep(self.insert_delay_s)
        with self.lock:
            self.inserted += hashes
        return len(hashes), 0

    def remove(self, digest: bytes, hashes: list[bytes]) -> int:
        self._fault("remove")
        with self.lock:
            self.removed += hashes
        return len(hashes)

    def leave(self) -> int:
        return 0

    def close(self) -> None:
        pass


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


class Held:
    """The node's blocks, as the snapshot coroutine hands them over."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes
        self.snapshots = 0

    async def __call__(self) -> dict[bytes, list[bytes]]:
        self.snapshots += 1
        return {NS: list(self.hashes)}


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.01)


def run(test: Callable[[], object]) -> None:
    asyncio.run(test())  # type: ignore[arg-type]


def started(
    client: FakeClient, held: Held, max_queued: int = 1 << 20
) -> tuple[Advertiser, Callable[[], None]]:
    a = Advertiser(client, "e", asyncio.get_running_loop(), held, max_queued)
    a.start()
    return a, lambda: a.close(leave=False)


def test_a_timed_out_remove_is_tried_again_without_a_rejoin() -> None:
    """DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED / UNAVAILABLE keep the join: no
    second Join, no re-send of the whole index, and the same withdrawal lands."""

    async def body() -> None:
        client = FakeClient(Terms())
        held = Held([h(i) for i in range(1000)])
        a, close = started(client, held)
        try:
            await until(lambda: len(client.inserted) == 1000)
            client.faults["remove"] = [
                Err(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"),
                Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"),
                Err(grpc.StatusCode.UNAVAILABLE, "overloaded"),
            ]
            gone = [h(5000 + i) for i in range(10)]
            a.withdraw(NS, gone)
            await until(lambda: a.counters.withdrawn == 10)
            await asyncio.sleep(0.2)
            assert client.removed == gone
            assert client.joins == 1 and a.counters.rejoins == 0
            assert held.snapshots == 1 and len(client.inserted) == 1000
            assert a.counters.dropped == 0 and a.counters.errors == 3
        finally:
            close()

    run(body)


def test_a_batch_that_keeps_failing_is_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(adv, "_BACKOFF_S", 0.01, raising=False)

    async def body() -> None:
        client = FakeClient(Terms())
        held = Held([])
        a, close = started(client, held)
        try:
            await until(lambda: a.joined.is_set())
            client.faults["remove"] = [
                Err(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")
            ] * adv._ATTEMPTS
            a.withdraw(NS, [h(i) for i in range(10)])
            await until(lambda: a.counters.dropped == 10)
            # The next batch goes out as usual; the join was kept all along.
            a.withdraw(NS, [h(99)])
            await until(lambda: a.counters.withdrawn == 1)
            assert client.removed == [h(99)]
            assert client.joins == 1 and held.snapshots == 1
            assert a.counters.errors == adv._ATTEMPTS
        finally:
            close()

    run(body)


def test_unknown_incarnation_joins_again_and_resends_everything() -> None:
    """The metaserver forgot this node: Join, the full re-send, and the batch
    that got the answer still lands. It goes first (it was queued before the
    re-send's snapshot was taken), so the test waits for both: it waited for
    the remove alone and then read the re-send's count, which the advertiser's
    thread had not always sent yet (a CI flake)."""

    async def body() -> None:
        client = FakeClient(Terms())
        held = Held([h(i) for i in range(100)])
        a, close = started(client, held)
        try:
            await until(lambda: len(client.inserted) == 100)
            client.faults["remove"] = [UNKNOWN]
            a.withdraw(NS, [h(7)])
            await until(
                lambda: a.counters.withdrawn == 1 and len(client.inserted) == 200
            )
            assert client.joins == 2 and a.counters.rejoins == 1
            assert held.snapshots == 2
            assert client.removed == [h(7)] and a.counters.dropped == 0
        finally:
            close()

    run(body)


def test_superseded_stops_advertising() -> None:
    async def body() -> None:
        client = FakeClient(Terms())
        a, close = started(client, Held([]))
        try:
            await until(lambda: a.joined.is_set())
            client.faults["insert"] = [
                Err(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "node.incarnation: superseded incarnation (node 'a' joined as 9)",
                )
            ]
            a.advertise(NS, [h(1)])
            await until(lambda: not a._thread.is_alive())
            assert client.joins == 1 and client.inserted == []
        finally:
            close()

    run(body)


def test_heartbeats_and_refresh_go_on_under_steady_saves() -> None:
    """A save every 5 ms (each Insert 10 ms) keeps the queue never empty: the
    drain still stops for heartbeats and half-TTL re-sends."""

    async def body() -> None:
        client = FakeClient(Terms(heartbeat_interval_s=0.2, ttl_s=0.6))
        client.insert_delay_s = 0.01
        held = Held([h(0)])
        a, close = started(client, held)
        try:
            await until(lambda: client.heartbeats >= 1)
            beats, snaps = client.heartbeats, held.snapshots

            def caught_up() -> bool:
                return client.heartbeats - beats >= 3 and held.snapshots - snaps >= 2

            # Saves go on until 3 heartbeats and 2 re-sends came (0.6 s when
            # idle), or 20 s: before, none ever came while the queue was fed.
            t0, i = time.monotonic(), 1
            while not caught_up() and time.monotonic() - t0 < 20:
                a.advertise(NS, [h(i)])
                i += 1
                await asyncio.sleep(0.005)
            assert caught_up(), (client.heartbeats - beats, held.snapshots - snaps)
        finally:
            close()

    run(body)


def test_a_withdrawal_on_a_full_queue_drops_queued_advertisements() -> None:
    """A lost withdrawal is a stale entry until the TTL (peers sent here for
    nothing), a lost advertisement a miss until the next refresh."""

    async def body() -> None:
        client = FakeClient(Terms())
        a = Advertiser(client, "e", asyncio.get_running_loop(), Held([]), 5)
        a.advertise(NS, [h(1)])
        a.advertise(NS, [h(2), h(3)])
        a.advertise(NS, [h(4), h(5)])  # the queue is full
        a.withdraw(NS, [h(9)])  # room made: the newest advertisement goes
        assert a.counters.dropped == 2
        a.advertise(NS, [h(6), h(7)])  # an advertisement never makes room
        assert a.counters.dropped == 4
        a.withdraw(NS, [h(10)])  # fits
        a.withdraw(NS, [h(11)])  # [2, 3] goes; the withdrawals keep their order
        assert a.counters.dropped == 6
        a.withdraw(NS, [h(12), h(13), h(14)])  # too few advertisements to drop
        assert a.counters.dropped == 9
        a.start()
        try:
            await until(lambda: a.counters.withdrawn == 3)
            assert client.inserted == [h(1)]
            assert client.removed == [h(9), h(10), h(11)]
        finally:
            a.close(leave=False)

    run(body)
