"""One owner's part of a remote fetch (pegaflow.tiers.remote.link plans it): pin
the blocks at the owner, check its answer against our geometry, read the slots
one-sided in pieces, hashing each as it lands, compare with the owner's
checksums, release the pin. A failure marks the run's blocks, with its cause,
through `fail`; nothing here publishes a block."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
import numpy as np

from pegaflow.cache.block_store import BlockEntry
from pegaflow.cache.pool import HostPool
from pegaflow.common.keys import Key, Namespace
from pegaflow.proto import metaserver_pb2 as meta_pb
from pegaflow.proto import peer_pb2 as peer_pb

from .peers import Endpoint, PeerChannels
from .remote_metrics import RemoteMetrics, RemoteStats
from .slot_sums import SlotHasher, bound
from .transfer_engine import RemoteTransport, TransportError, Wait

logger = logging.getLogger(__name__)

_RELEASE_TIMEOUT_S = 2.0
_HOLD_MARGIN_S = 2.0  # a pin is asked to outlive our fetch deadline by this
# A fetch is read in pieces of at least this size, about _MAX_PIECES at most
# of them, all submitted at once, each hashed once it landed while the later
# ones travel: only the last piece's hashing is left after the transfer. Read
# one after another (each waited for before the next was asked), pieces cost
# more than they hid (dev VM, 64 MiB: 100 ms in one piece, 154 in 16 MiB
# ones). Submitted at once on the H200 host (benchmarks/RESULTS.md, fourth
# session): 256 MiB fetches 1.05-1.10 x raw TCP in 16 MiB pieces against
# 0.94-0.98 in one, the hashing left after the transfer 2 ms against 7; a
# 1.25 GiB fetch in 80 such pieces was no faster: hence the cap.
_PIECE_BYTES = 16 << 20
_MAX_PIECES = 8


@dataclass(frozen=True, slots=True)
class PlanSegment:
    endpoint: Endpoint
    start: int  # index into the fetched run
    blocks: int
    incarnation: int = 0  # the owner's, as the metaserver knows it


class OwnerReads:
    def __init__(
        self,
        peers: PeerChannels,
        transport: RemoteTransport,
        pool: HostPool,
        metrics: RemoteMetrics,
        stats: RemoteStats,
        node_id: str,
        fail: Callable[[list[Key], str], None],
        tasks: set[asyncio.Task[None]],
        hasher: SlotHasher,
    ) -> None:
        self._hasher = hasher
        self._peers = peers
        self._transport = transport
        self._pool = pool
        self._metrics = metrics
        self._stats = stats
        self.node_id = node_id
        self._fail = fail
        self._tasks = tasks  # the link's: it waits for them at close

    async def run(
        self,
        ns: Namespace,
        digest: bytes,
        entries: list[BlockEntry],
        seg: PlanSegment,
        ok: np.ndarray,
        tainted: np.ndarray,
        deadline: float,
    ) -> None:
        """One owner's run: pin, check, read, verify, release. Marks ok[i]
        for the blocks that arrived intact and tainted[i] for those whose read
        failed with bytes still in flight (their slots must be quarantined).

        An owner pins at most a share of its pool for readers
        (pins.MAX_PINNED_SHARE): a longer run is granted its head, and the
        rest is pinned in another round once that head was read and released.
        Only a round granted nothing is the owner no longer holding the block
        (peer_evicted)."""
        at, end = seg.start, seg.start + seg.blocks
        while at < end:
            got = await self._round(
                ns, digest, entries[at:end], seg, at, ok, tainted, deadline
            )
            if not got:
                return
            at += got
        self._stats.peers_seen.add(seg.endpoint.rpc)

    async def _round(
        self,
        ns: Namespace,
        digest: bytes,
        run: list[BlockEntry],
        seg: PlanSegment,
        at: int,
        ok: np.ndarray,
        tainted: np.ndarray,
        deadline: float,
    ) -> int:
        """Pin, read and verify run's head (run[0] is the run's block `at`);
        the blocks this round covered, 0 when the run must stop (its blocks
        left are failed, with their cause, here)."""
        keys = [e.key for e in run]
        left = deadline - time.monotonic()
        request = peer_pb.PinRequest(
            namespace=digest,
            hash_len=len(keys[0][1]),
            hashes=b"".join(k[1] for k in keys),
            hold_ms=int((left + _HOLD_MARGIN_S) * 1000),
            slot_bytes=ns.slot_bytes,
            shards=ns.tp_size,
            reader_node_id=self.node_id,
        )
        pinned = time.monotonic()
        try:
            pin = await self._peers.pin(
                seg.endpoint.rpc, request, max(left, 0.001), seg.incarnation
            )
        except grpc.RpcError as exc:
            logger.info("peer %s: pin failed: %s", seg.endpoint.rpc, exc.code())
            self._fail(keys, "peer_unreachable")
            return 0
        granted_until = time.monotonic() + pin.hold_ms / 1000
        phases = self._stats.last_phases_ms
        phases["pin"] = elapsed_ms(pinned)
        try:
            remote, sums = check_pin(pin, len(run), ns)
        except Refused as refused:
            self._release_soon(seg.endpoint.rpc, pin.pin_id)
            self._fail(keys, refused.cause)
            return 0
        n = len(remote)
        local = np.array([e.slots for e in run[:n]], np.uint64)
        # Read only inside the hold the owner granted: past it the owner may
        # reuse those slots.
        if min(granted_until, deadline) - time.monotonic() <= 0:
            self._release_soon(seg.endpoint.rpc, pin.pin_id)
            self._fail(keys, "pin_expired")
            return 0
        later = None
        if sums is None:  # the owner hashes while we read
            wait = max(deadline - time.monotonic(), 0.001)
            later = asyncio.ensure_future(
                self._peers.checksums(seg.endpoint.rpc, pin.pin_id, wait)
            )
        reading = time.monotonic()
        try:
            raw = await asyncio.to_thread(
                self._read_and_hash, seg.endpoint.transfer, local, remote,
                ns.slot_bytes, phases,
            )  # fmt: skip
            phases["read"] = elapsed_ms(reading)
            if later is not None:
                sums = checksums_from(await later, local.shape)
            phases["checksums_wait"] = elapsed_ms(reading) - phases["read"]
        except TransportError as exc:
            logger.info("peer %s: %s", seg.endpoint.transfer, exc)
            if exc.in_flight:
                tainted[at : at + n] = True
            self._release_soon(seg.endpoint.rpc, pin.pin_id)
            self._fail(keys, "transport")
            return 0
        except (grpc.RpcError, Refused) as exc:
            logger.info("peer %s: no checksums: %s", seg.endpoint.rpc, exc)
            self._release_soon(seg.endpoint.rpc, pin.pin_id)
            self._fail(keys, "peer_unreachable")
            return 0
        finally:
            if later is not None and not later.done():
                later.cancel()
        if n < len(run):  # the rest is pinned next: this pin's share back first
            await self._release(seg.endpoint.rpc, pin.pin_id)
        else:
            self._release_soon(seg.endpoint.rpc, pin.pin_id)
        # Bound to the keys we asked for: another block's bytes with their own
        # true checksums, answered under these hashes, do not match.
        mine = bound(digest, [k[1] for k in keys[:n]], raw)
        intact = (mine == sums).all(axis=1)
        bad = np.flatnonzero(~intact)
        if len(bad):
            logger.warning(
                "peer %s: %d of %d blocks failed their checksum; dropped",
                seg.endpoint.rpc, len(bad), n,
            )  # fmt: skip
            self._fail([keys[i] for i in bad.tolist()], "checksum")
        ok[at : at + n] = intact
        return n

    def _read_and_hash(
        self,
        endpoint: str,
        local: np.ndarray,
        remote: np.ndarray,
        slot_bytes: int,
        phases: dict[str, float],
    ) -> np.ndarray:
        """On a worker thread: the read submitted in pieces at once (see
        _PIECE_BYTES), each piece hashed (on the hasher's threads) as soon as it
        landed while the later ones still travel. The checksum of every slot
        read ([blocks, shards]). Returns only once every byte of the read
        landed; raises TransportError once the transport reported on every
        piece, with in_flight set when bytes may still land later."""
        shards = local.shape[1]
        block_bytes = slot_bytes * shards
        piece = max(_PIECE_BYTES, -(-len(local) * block_bytes // _MAX_PIECES))
        per = max(1, piece // block_bytes)
        flat_local, flat_remote = local.reshape(-1), remote.reshape(-1)
        lengths = np.full(flat_local.size, slot_bytes, np.uint64)
        before = self._transport.retried
        began = time.monotonic()
        cuts = [  # per piece, not per block
            (a * shards, min(len(local), a + per) * shards)
            for a in range(0, len(local), per)
        ]
        waits: list[Wait] = []
        try:
            for a, b in cuts:
                waits.append(
                    self._transport.submit(
                        endpoint, flat_local[a:b], flat_remote[a:b], lengths[a:b]
                    )
                )
        except BaseException as exc:
            _give_up(waits, exc)
        hashed: list[concurrent.futures.Future[np.ndarray]] = []
        failure: TransportError | None = None
        in_flight = False
        with concurrent.futures.ThreadPoolExecutor(1) as pipeline:
            for i, ((a, b), wait) in enumerate(zip(cuts, waits, strict=True)):
                try:
                    # After a failure the rest are only waited out: a retry
                    # each (up to the transfer timeout apiece, a stopped peer)
                    # would add up, and the fetch fails anyway.
                    wait(retry=failure is None)
                except TransportError as exc:
                    failure = failure or exc
                    in_flight = in_flight or exc.in_flight
                    continue
                except BaseException as exc:
                    _give_up(waits[i + 1 :], exc)
                if failure is None:
                    hashed.append(
                        pipeline.submit(self._hasher.checksums, self._pool,
                                        flat_local[a:b], slot_bytes)
                    )  # fmt: skip
            last = time.monotonic()
            phases["transfer"] = round((last - began) * 1e3, 3)
            if failure is not None:
                raise TransportError(str(failure), in_flight) from failure
            sums = np.concatenate([f.result() for f in hashed]).reshape(local.shape)
        phases["hash"] = elapsed_ms(last)
        retried = self._transport.retried - before
        if retried:
            self._metrics.retries.inc(retried)
        return sums

    async def _release(self, addr: str, pin_id: int) -> None:
        try:
            await self._peers.release(addr, pin_id, _RELEASE_TIMEOUT_S)
        except grpc.RpcError as exc:  # the pin expires on its own
            logger.debug("release of pin %d at %s: %s", pin_id, addr, exc.code())

    def _release_soon(self, addr: str, pin_id: int) -> None:
        if not pin_id:
            return
        task = asyncio.ensure_future(self._release(addr, pin_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _give_up(waits: list[Wait], exc: BaseException) -> None:
    """After an unexpected error: the pieces not yet waited for are waited
    out, and the read fails as one whose bytes may still land (what the
    failed call left behind is unknown)."""
    for wait in waits:
        with contextlib.suppress(TransportError):
            wait(retry=False)
    raise TransportError(f"read abandoned: {exc!r}", in_flight=True) from exc


class Refused(Exception):
    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def check_pin(
    pin: peer_pb.PinResponse, asked: int, ns: Namespace
) -> tuple[np.ndarray, np.ndarray | None]:
    """The owner's answer, checked before anything is read: ([blocks, shards]
    remote slot addresses, their checksums). Raises Refused with the cause."""
    answered = pin.slot_bytes or pin.shards  # an empty answer says neither
    if answered and (pin.slot_bytes, pin.shards) != (ns.slot_bytes, ns.tp_size):
        raise Refused("geometry")
    if pin.pin_id == 0 or pin.blocks == 0:
        raise Refused("peer_evicted")
    if (pin.slot_bytes, pin.shards) != (ns.slot_bytes, ns.tp_size):
        raise Refused("geometry")  # blocks granted with no geometry said
    want = pin.blocks * pin.shards * 8
    if pin.blocks > asked or len(pin.slot_addrs) != want:
        raise Refused("geometry")
    if len(pin.checksums) not in (0, want):
        raise Refused("geometry")
    shape = (pin.blocks, pin.shards)
    remote = np.frombuffer(pin.slot_addrs, "<u8").astype(np.uint64).reshape(shape)
    sums = checksums_from(pin.checksums, shape) if pin.checksums else None
    return remote, sums


def checksums_from(raw: bytes, shape: tuple[int, int]) -> np.ndarray:
    """The owner's checksums; Refused when they do not fit the pin."""
    if len(raw) != shape[0] * shape[1] * 8:
        raise Refused("geometry")
    return np.frombuffer(raw, "<u8").astype(np.uint64).reshape(shape)


def elapsed_ms(since: float) -> float:
    return round((time.monotonic() - since) * 1e3, 3)


def plan_from(
    segments: Iterable[meta_pb.Segment], node_id: str, count: int
) -> list[PlanSegment]:
    """The metaserver's plan of `count` hashes as our segments: up to the first
    naming us (never read from ourselves) or none; ValueError when it covers
    more than was asked or names an endpoint that is no HOST:PORT pair."""
    plan: list[PlanSegment] = []
    at = 0
    for seg in segments:
        if seg.node_id == node_id or seg.blocks == 0:
            break  # a lying plan stops here
        endpoint = Endpoint.parse(seg.endpoint)
        plan.append(PlanSegment(endpoint, at, seg.blocks, seg.incarnation))
        at += seg.blocks
    if at > count:
        raise ValueError(f"metaserver plan covers {at} of {count} blocks")
    return plan


def clip_plan(plan: list[PlanSegment], n: int) -> list[PlanSegment]:
    """The plan cut to the first n blocks (fewer slots were reserved)."""
    out = []
    for seg in plan:
        if seg.start >= n:
            break
        blocks = min(seg.blocks, n - seg.start)
        out.append(PlanSegment(seg.endpoint, seg.start, blocks, seg.incarnation))
    return out
