"""This node's side of the metaserver's soft state: join, heartbeats, and the
blocks it holds advertised (sealed) and withdrawn (evicted) in batches, off the
RPC path, through one bounded queue (full: the batch is dropped and counted; a
save never waits).

The metaserver forgets a node that restarts, that it dropped as stale, or when
it restarts itself: it then answers FAILED_PRECONDITION "unknown incarnation",
and this node joins again and re-sends every block it holds (a snapshot taken
on the event loop in slices), so the index is whole again within one
heartbeat period. The same re-send runs every half TTL, so entries the
metaserver holds never expire under a live node.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc

from ..metaserver.client import JoinTerms, MetaClient

logger = logging.getLogger(__name__)

INSERT, REMOVE = "insert", "remove"
_RETRY_S = 1.0  # a metaserver that is down is tried again this often
# How long a batch waits for more hashes before it is sent: the index lags a
# save by at most this (plus the RPC), and a burst of saves shares one Insert.
LINGER_S = 0.02
# Snapshot of everything held: digest -> its ready hashes (one length each).
Snapshot = Callable[[], Coroutine[None, None, dict[bytes, list[bytes]]]]


@dataclass(slots=True)
class AdvertiserCounters:
    advertised: int = 0  # hashes sent in Insert
    withdrawn: int = 0  # hashes sent in Remove
    dropped: int = 0  # hashes not sent: queue full or the metaserver down
    rejoins: int = 0  # joins after the first (metaserver restart, stale, ttl)
    errors: int = 0


class Advertiser:
    def __init__(
        self,
        client: MetaClient,
        endpoint: str,
        loop: asyncio.AbstractEventLoop,
        snapshot: Snapshot,
        max_queued_hashes: int = 1 << 20,
    ) -> None:
        self._client = client
        self._endpoint = endpoint
        self._loop = loop
        self._snapshot = snapshot
        self._max_queued = max_queued_hashes
        self._queue: deque[tuple[str, bytes, list[bytes]]] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._stop = False
        self.counters = AdvertiserCounters()
        self.terms: JoinTerms | None = None
        self.joined = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="pegaflow-advertiser", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    # -- from the event loop ------------------------------------------------------
    def advertise(self, digest: bytes, hashes: list[bytes]) -> None:
        self._put(INSERT, digest, hashes)

    def withdraw(self, digest: bytes, hashes: list[bytes]) -> None:
        self._put(REMOVE, digest, hashes)

    def _put(self, op: str, digest: bytes, hashes: list[bytes]) -> None:
        if not hashes:
            return
        with self._cond:
            if self._queued + len(hashes) > self._max_queued:
                self.counters.dropped += len(hashes)
                return
            self._queue.append((op, digest, hashes))
            self._queued += len(hashes)
            self._cond.notify()

    # -- on its own thread ----------------------------------------------------------
    def _run(self) -> None:
        next_beat = next_refresh = 0.0
        while not self._stop:
            try:
                if self.terms is None:
                    self._join()
                    next_beat = time.monotonic() + self.terms.heartbeat_interval_s
                    next_refresh = time.monotonic() + self.terms.ttl_s / 2
                now = time.monotonic()
                if now >= next_beat:
                    self._client.heartbeat()
                    next_beat = now + self.terms.heartbeat_interval_s
                if now >= next_refresh:
                    self._resend_all()
                    next_refresh = now + self.terms.ttl_s / 2
                self._drain(next_beat)
            except grpc.RpcError as exc:
                self._failed(exc)
            except Exception:  # a background loop: log it and go on
                self.counters.errors += 1
                logger.exception("advertiser")
                self._wait(_RETRY_S)

    def _join(self) -> None:
        terms = self._client.join(self._endpoint)
        if self.joined.is_set():
            self.counters.rejoins += 1
        self.terms = terms
        # What is queued stays: an insert in it is also in the snapshot (sent
        # twice, harmless), a remove after it still has to reach the index.
        self._resend_all()
        self.joined.set()
        logger.info("joined the metaserver at %s", self._client.addr)

    def _failed(self, exc: grpc.RpcError) -> None:
        self.counters.errors += 1
        code = exc.code() if hasattr(exc, "code") else None
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            detail = exc.details() or ""
            if "superseded" in detail:  # a newer process of this node id joined
                logger.error("metaserver: %s; this server stops advertising", detail)
                self._stop = True
                return
            logger.info("metaserver forgot this node (%s): joining again", detail)
        else:
            logger.warning(
                "metaserver at %s: %s", self._client.addr, code or type(exc).__name__
            )
            self._wait(_RETRY_S)
        self.terms = None  # join again; what was queued meanwhile is in the snapshot

    def _drain(self, until: float) -> None:
        batch_limit = self.terms.max_batch_hashes if self.terms else 4096
        while not self._stop:
            with self._cond:
                timeout = until - time.monotonic()
                if not self._queue and timeout > 0:
                    self._cond.wait(timeout)
                if not self._queue:
                    return
                # Linger a moment for the saves behind this one: one Insert
                # for many saves costs each of them less than its own RPC.
                linger_end = time.monotonic() + LINGER_S
                while self._queued < batch_limit and not self._stop:
                    left = linger_end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                op, digest, hashes = self._take(batch_limit)
            self._send(op, digest, hashes, batch_limit)

    def _take(self, limit: int) -> tuple[str, bytes, list[bytes]]:
        """The head batch, merged with the ones behind it of the same op,
        namespace and hash length, up to limit hashes (caller holds the lock)."""
        op, digest, hashes = self._queue.popleft()
        hashes = list(hashes)
        while self._queue and len(hashes) < limit:
            nop, ndigest, more = self._queue[0]
            if (nop, ndigest) != (op, digest) or len(more[0]) != len(hashes[0]):
                break
            if len(hashes) + len(more) > limit:
                break
            self._queue.popleft()
            hashes += more
        self._queued -= len(hashes)
        return op, digest, hashes

    def _send(self, op: str, digest: bytes, hashes: list[bytes], limit: int) -> None:
        for start in range(0, len(hashes), limit):  # per batch, not per block
            part = hashes[start : start + limit]
            if op == INSERT:
                self._client.insert(digest, part)
                self.counters.advertised += len(part)
            else:
                self._client.remove(digest, part)
                self.counters.withdrawn += len(part)

    def _resend_all(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        held = future.result(timeout=60)
        limit = self.terms.max_batch_hashes if self.terms else 4096
        for digest, hashes in held.items():
            by_len: dict[int, list[bytes]] = {}
            for h in hashes:
                by_len.setdefault(len(h), []).append(h)
            for same in by_len.values():
                self._send(INSERT, digest, same, limit)

    def _wait(self, seconds: float) -> None:
        with self._cond:
            if not self._stop:
                self._cond.wait(seconds)

    def close(self, leave: bool = True) -> None:
        """Stop the thread; leave: drop this node's entries at the metaserver
        now (a clean shutdown) instead of when it goes stale."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if leave and self.terms is not None:
            try:
                self._client.leave()
            except grpc.RpcError as exc:
                logger.info("metaserver leave failed: %s", exc.code())
        self._client.close()
