"""This node's side of the metaserver's soft state: join, heartbeats, and the
blocks it holds advertised (sealed) and withdrawn (evicted) in batches, off the
RPC path, through one bounded queue (full: the batch is dropped and counted; a
withdrawal first drops queued advertisements, newest first; a save never
waits).

The metaserver forgets a node that restarts, that it dropped as stale, or when
it restarts itself: it then answers FAILED_PRECONDITION "unknown incarnation",
and this node joins again and re-sends every block it holds (a snapshot taken
on the event loop in slices), so the index is whole again within one
heartbeat period. The same re-send runs every half TTL, so entries the
metaserver holds never expire under a live node. Any other error (a deadline,
an overloaded or unreachable metaserver) keeps the join: the batch is tried
again after a backoff, and dropped (counted) after _ATTEMPTS tries. Sending
stops for each heartbeat and refresh when it is due, however much is queued.
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

from pegaflow.metaserver.meta_client import JoinTerms, MetaClient

logger = logging.getLogger(__name__)

INSERT, REMOVE = "insert", "remove"
_RETRY_S = 1.0  # a metaserver that is down is tried again this often
# A batch that failed (not "unknown incarnation") is tried again after
# _BACKOFF_S, doubling up to _RETRY_S, and dropped after _ATTEMPTS tries.
_BACKOFF_S = 0.1
_ATTEMPTS = 6  # about 2.5 s of backoff (each try up to the deadline)
# How long a batch waits for more hashes before it is sent: the index lags a
# save by at most this (plus the RPC), and a burst of saves shares one Insert.
LINGER_S = 0.02
# Snapshot of everything held: digest -> its ready hashes (one length each).
Snapshot = Callable[[], Coroutine[None, None, dict[bytes, list[bytes]]]]
Batch = tuple[str, bytes, list[bytes]]  # op, namespace digest, hashes
# What an RPC error asks of this node (see _verdict).
_RETRY, _REJOIN, _STOP = "retry", "rejoin", "stop"


@dataclass(slots=True)
class AdvertiserCounters:
    advertised: int = 0  # hashes sent in Insert
    withdrawn: int = 0  # hashes sent in Remove
    dropped: int = 0  # hashes not sent: queue full or the metaserver failing
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
        self._queue: deque[Batch] = deque()
        self._queued = 0
        self._queued_inserts = 0  # of _queued, hashes in INSERT batches
        # Thread-only: the batch being sent (taken from the queue or the
        # re-send, kept across failed tries), what is left of the last
        # snapshot to re-send, and the head batch's failed tries.
        self._pending: Batch | None = None
        self._resend: deque[Batch] = deque()
        self._attempts = 0
        self._retry_at = 0.0
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
        n = len(hashes)
        with self._cond:
            short = self._queued + n - self._max_queued
            if short > 0 and op == REMOVE and self._queued_inserts >= short:
                # A lost withdrawal leaves a stale entry (peers sent here for
                # nothing) until the TTL; a lost advertisement only a miss
                # until the next refresh: withdrawals go first.
                self._drop_inserts(short)
            if self._queued + n > self._max_queued:
                self.counters.dropped += n
                return
            self._queue.append((op, digest, hashes))
            self._queued += n
            if op == INSERT:
                self._queued_inserts += n
            self._cond.notify()

    def _drop_inserts(self, need: int) -> None:
        """Drop queued INSERT batches, newest first, until need hashes are
        free; the REMOVE batches stay, in order (caller holds the lock)."""
        kept: list[Batch] = []
        freed = 0
        while freed < need:
            batch = self._queue.pop()
            if batch[0] == INSERT:
                freed += len(batch[2])
            else:
                kept.append(batch)
        self._queue.extend(reversed(kept))
        self._queued -= freed
        self._queued_inserts -= freed
        self.counters.dropped += freed

    # -- on its own thread ----------------------------------------------------------
    def _run(self) -> None:
        next_beat = next_refresh = 0.0
        while not self._stop:
            try:
                if self.terms is None:
                    self._join()
                    next_beat = time.monotonic() + self.terms.heartbeat_interval_s
                    next_refresh = 0.0  # re-send everything held, now
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = self._heartbeat()
                if now >= next_refresh:
                    self._load_snapshot()
                    next_refresh = time.monotonic() + self.terms.ttl_s / 2
                self._drain(min(next_beat, next_refresh))
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
        # What is queued (and the batch in flight) stays: an insert in it is
        # also in the snapshot (sent twice, harmless), a remove after it
        # still has to reach the index.
        self._attempts, self._retry_at = 0, 0.0
        self.joined.set()
        logger.info("joined the metaserver at %s", self._client.addr)

    def _heartbeat(self) -> float:
        """Send one; when the next is due (sooner after a failed one)."""
        interval = self.terms.heartbeat_interval_s
        try:
            self._client.heartbeat()
        except grpc.RpcError as exc:
            if self._verdict(exc) != _RETRY:
                raise
            self.counters.errors += 1
            logger.warning(
                "metaserver at %s: heartbeat: %s", self._client.addr, _code(exc)
            )
            return time.monotonic() + min(interval, _RETRY_S)
        return time.monotonic() + interval

    @staticmethod
    def _verdict(exc: grpc.RpcError) -> str:
        """The metaserver's FAILED_PRECONDITION (nodes.UnknownIncarnation,
        nodes.Superseded) is the only answer that the join is gone; anything
        else (a deadline, RESOURCE_EXHAUSTED, UNAVAILABLE) is tried again."""
        if _code(exc) == grpc.StatusCode.FAILED_PRECONDITION:
            detail = exc.details() or ""
            if "superseded" in detail:
                return _STOP
            if "unknown incarnation" in detail:
                return _REJOIN
        return _RETRY

    def _failed(self, exc: grpc.RpcError) -> None:
        self.counters.errors += 1
        verdict = self._verdict(exc)
        if verdict == _STOP:  # a newer process of this node id joined
            logger.error("metaserver: %s; this server stops advertising", exc.details())
            self._stop = True
        elif verdict == _REJOIN:
            logger.info(
                "metaserver forgot this node (%s): joining again", exc.details()
            )
            self.terms = None  # join, then re-send what is held
            self._resend.clear()
        else:  # Join failed (a batch or a heartbeat retries its own)
            logger.warning("metaserver at %s: %s", self._client.addr, _code(exc))
            self._wait(_RETRY_S)

    def _drain(self, until: float) -> None:
        """Send batches until `until` (the next heartbeat or refresh) comes,
        even with work left: a steady stream of saves never starves them. The
        re-send goes before the queue (what was queued after the snapshot has
        to land after it)."""
        while not self._stop:
            now = time.monotonic()
            if now >= until:
                return
            if self._pending is None and self._resend:
                self._pending = self._resend.popleft()
            if self._pending is None:
                self._pending = self._collect(until)
                if self._pending is None:
                    return
            elif now < self._retry_at:
                self._wait(min(self._retry_at, until) - now)
            else:
                self._send_pending()

    def _collect(self, until: float) -> Batch | None:
        """The next batch off the queue, waiting for one until `until`."""
        batch_limit = self._limit()
        with self._cond:
            timeout = until - time.monotonic()
            if not self._queue and timeout > 0 and not self._stop:
                self._cond.wait(timeout)
            if not self._queue:
                return None
            # Linger a moment for the saves behind this one: one Insert
            # for many saves costs each of them less than its own RPC.
            linger_end = time.monotonic() + LINGER_S
            while self._queued < batch_limit and not self._stop:
                left = linger_end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._take(batch_limit)

    def _send_pending(self) -> None:
        """Send the pending batch's next part; on an error other than the
        metaserver's "unknown incarnation"/"superseded" (raised) keep it, to be
        tried again after a backoff, or drop it (counted) after _ATTEMPTS."""
        assert self._pending is not None
        op, digest, hashes = self._pending
        limit = self._limit()
        part = hashes[:limit]  # per batch, not per block
        try:
            if op == INSERT:
                self._client.insert(digest, part)
                self.counters.advertised += len(part)
            else:
                self._client.remove(digest, part)
                self.counters.withdrawn += len(part)
        except grpc.RpcError as exc:
            if self._verdict(exc) != _RETRY:
                raise
            self.counters.errors += 1
            self._attempts += 1
            if self._attempts < _ATTEMPTS:
                backoff = min(_RETRY_S, _BACKOFF_S * 2 ** (self._attempts - 1))
                self._retry_at = time.monotonic() + backoff
                return
            logger.warning(
                "metaserver at %s: %s %d hashes dropped after %d tries: %s",
                self._client.addr,
                op,
                len(hashes),
                self._attempts,
                _code(exc),
            )
            self.counters.dropped += len(hashes)
            rest: list[bytes] = []
        else:
            rest = hashes[limit:]
        self._pending = (op, digest, rest) if rest else None
        self._attempts, self._retry_at = 0, 0.0

    def _limit(self) -> int:
        return self.terms.max_batch_hashes if self.terms else 4096

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
        if op == INSERT:
            self._queued_inserts -= len(hashes)
        return op, digest, hashes

    def _load_snapshot(self) -> None:
        """Queue a re-send of everything held (it replaces what is left of
        the last one), sent by _drain in batches before the queue."""
        future = asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop)
        held = future.result(timeout=60)
        limit = self._limit()
        resend: deque[Batch] = deque()
        for digest, hashes in held.items():
            by_len: dict[int, list[bytes]] = {}
            for h in hashes:
                by_len.setdefault(len(h), []).append(h)
            for same in by_len.values():
                for start in range(0, len(same), limit):
                    resend.append((INSERT, digest, same[start : start + limit]))
        self._resend = resend

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


def _code(exc: grpc.RpcError) -> grpc.StatusCode | str:
    return exc.code() if hasattr(exc, "code") else type(exc).__name__
