"""The server's unix socket: registrations, queries, saves and loads.

The scheduler asks once per waiting request per step and a worker saves and
loads once per step; a Python gRPC round trip costs ~1 ms against ~0.15 ms for
a framed unix-socket exchange (benchmarks/RESULTS.md). The kernel tells the
server who is asking (SO_PEERCRED), and a host engine hands it the sealed memfd
behind its KV memory here (pegaflow.server.socket_share: SCM_RIGHTS, from the
registering process only). gRPC stays the reference API; the client
(pegaflow.client.socket_transport) falls back to it. Frames:
pegaflow.common.socket_frames.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pegaflow.common import deadlines
from pegaflow.common.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    Overloaded,
    PegaflowError,
    PermissionDenied,
    ProtocolMismatch,
)
from pegaflow.common.identity import UNKNOWN, CallContext, Caller, unix_peer
from pegaflow.common.results import QueryResult
from pegaflow.common.share_frames import SHARE
from pegaflow.common.socket_frames import (
    HELLO_REPLY,
    LOAD,
    MAX_BODY,
    PROTOCOL_VERSION,
    QUERY,
    REGISTER,
    REPLY_ALLOWANCE,
    SAVE,
    SAVE_REPLY,
    decode_hello,
    decode_load,
    decode_query,
    decode_register,
    decode_save,
    error_reply,
    kind_of,
    load_reply,
    query_reply,
    register_reply,
    reply_bound,
)
from pegaflow.daemon.boundary import guarded, guarded_sync

from .socket_file import bind_private_unix, unlink_if_ours
from .socket_peer import hung_up, peer_exited, unread
from .socket_share import FdLost, share

if TYPE_CHECKING:
    from .engine import Engine

logger = logging.getLogger(__name__)

# Partial frames buffered over all connections at once; past it a connection
# that wants more is refused. A legitimate frame arrives whole within
# milliseconds, so this only bounds what slow or stuck senders can pin.
RECEIVE_BUDGET = 128 << 20
# Whole frames waiting behind a slow save or load, per connection: past this
# the connection is not read until its queue drains to half (a client that
# pipelines without waiting must not grow the server's memory without bound).
QUEUED_PAUSE_BYTES = 64 << 20
# Replies a client does not read pause its reading the same way, and the
# answering of what it queued.
WRITE_HIGH_BYTES = 16 << 20
# Both of those over all connections, each queued request (a connection's first
# too) with the most its reply can take. One past it is refused unless nothing else
# is charged or it is lone (nothing queued or unread on its connection: an engine's)
# and at most LONE_BYTES (so MAX_CONNECTIONS x LONE_BYTES past it at most); a
# pipelining client is closed, another may retry. One budget, not one per uid: only
# the server's user and root connect (0600).
BACKLOG_BUDGET = 256 << 20
LONE_BYTES = 64 << 10  # a 64-block load or a save of hundreds of hashes
MAX_CONNECTIONS = 1024
REFUSED_LINGER_S = 2.0  # a refused connection drains this long, then closes
# A client sends its hello as it connects and each frame in one sendall: one
# that takes longer is stuck or hostile, and would hold its connection slot
# and its partial frame for ever. An idle engine between two requests (no
# frame begun) is never timed out.
HELLO_TIMEOUT_S = 5.0  # from connecting to the whole hello
FRAME_TIMEOUT_S = 5.0  # from a frame's first byte to its last, while read
# An engine reads each reply as it comes (it waits for it); replies left
# unread hold the server's memory, and BACKLOG_BUDGET with it. A connection
# whose buffered replies do not move for this long is closed (its reader is
# stuck or gone).
UNREAD_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class SocketServerInfo:
    """What a registration over the socket answers with (as ServerInfo does)."""

    pid: int
    server_id: bytes
    path: str


@dataclass(slots=True)
class _Shared:
    """State of one socket server shared by its connections."""

    engine: Engine
    info: SocketServerInfo
    buffered: int = 0  # bytes of partial frames over all connections
    connections: int = 0
    backlog: int = 0  # bytes queued or unsent over all connections
    backlogged: set[_SocketProtocol] = field(default_factory=set)  # backlog > 0


class _SocketProtocol(asyncio.Protocol):
    """One engine connection. Queries are answered straight from the loop's read
    callback; a save, load or registration runs as a task, and frames behind it
    wait their turn, so replies leave in request order.

    The kernel names the peer (SO_PEERCRED) when it connects: that, not any
    field of a frame, is who the requests come from."""

    def __init__(self, shared: _Shared) -> None:
        self._shared = shared
        self._engine = shared.engine
        self._metrics = shared.engine.metrics
        self._buf = bytearray()
        self._counted = 0  # of _buf, charged to the shared receive budget
        self._transport: asyncio.Transport | None = None
        self._caller = Caller("unix")
        self._greeted = False
        self._discard = False  # refused: the rest of the input is dropped
        self._queued: deque[bytes | QueryResult] = deque()
        self._task: asyncio.Task | None = None
        self._eof = False
        self._queued_bytes = 0
        self._reading = True
        self._writable = True
        self._can_write = asyncio.Event()  # as _writable, for _drain to await
        self._can_write.set()
        self._backlog = 0  # charged to the shared backlog
        self._owed = 0  # the most the queued requests' replies can take
        self._lost = False
        self._hung_up = False  # the client closed its end, not just its writes
        self._fd_wait = False  # a share's descriptor is read with recvmsg
        self._timer: asyncio.TimerHandle | None = None  # hello's, or a frame's
        self._unread_timer: asyncio.TimerHandle | None = None
        self._written = 0  # reply bytes handed to the transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._transport.set_write_buffer_limits(high=WRITE_HIGH_BYTES)
        self._shared.connections += 1
        if self._shared.connections > MAX_CONNECTIONS:
            self._refuse(
                Overloaded(f"connection: more than {MAX_CONNECTIONS} open"),
                "connections",
            )
            return
        self._arm(HELLO_TIMEOUT_S, f"hello: none within {HELLO_TIMEOUT_S:g} s")
        try:
            self._caller = unix_peer(transport.get_extra_info("socket"))
        except OSError as exc:  # no credentials: nothing may be trusted
            logger.warning("fast-path peer without credentials: %s", exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._shared.connections -= 1
        self._charge(0)
        self._account()
        self._disarm()
        if self._unread_timer is not None:
            self._unread_timer.cancel()
            self._unread_timer = None
        self._can_write.set()  # _drain must not wait on a connection gone

    def _arm(self, after_s: float, why: str) -> None:
        """Refuse the connection unless _disarm() comes within after_s."""
        self._disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(after_s, self._expired, after_s, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, after_s: float, why: str) -> None:
        self._timer = None
        if self._discard or self._transport.is_closing():
            return
        if self._reading and unread(self._transport.get_extra_info("socket")):
            # Bytes wait in the kernel: the loop was late (a stall), not the
            # client; a stuck client's bytes were all read by now.
            self._arm(after_s, why)
            return
        self._refuse(DeadlineExceeded(why), "timeout")

    def _time_frame(self, restart: bool) -> None:
        """Time the partial frame in _buf, from its first byte (restart: it
        began in this read); only while the connection is read, as the client
        cannot send the rest meanwhile."""
        if not self._greeted:
            return  # the hello's own timer runs
        if not self._buf or not self._reading:
            self._disarm()
        elif restart or self._timer is None:
            have = len(self._buf)
            size = (
                f"{4 + int.from_bytes(self._buf[:4], 'little')}" if have >= 4 else "4+"
            )
            self._arm(
                FRAME_TIMEOUT_S,
                f"frame: {have} of its {size} B arrived within "
                f"{FRAME_TIMEOUT_S:g} s; a frame must be sent whole",
            )

    def _refuse(self, exc: PegaflowError, reason: str) -> None:
        """Answer with the error and stop. Whatever the peer still sends is
        read and dropped for a moment: closing with unread bytes would reset
        the connection and lose the error before the peer read it. What the
        peer has not read by then is dropped (it may never read)."""
        self._metrics.socket_refusals.labels(reason).inc()
        self._discard = True
        self._disarm()
        self._buf.clear()
        self._charge(0)
        self._transport.write(error_reply(exc))
        if self._transport.can_write_eof():
            self._transport.write_eof()
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self._end)

    def _end(self) -> None:
        transport = self._transport
        transport.abort() if transport.get_write_buffer_size() else transport.close()

    def _charge(self, size: int) -> None:
        """Charge the shared budget for `size` bytes of partial frame."""
        self._shared.buffered += size - self._counted
        self._counted = size

    def data_received(self, data: bytes) -> None:
        if self._discard:
            return
        buf = self._buf
        buf += data  # amortised O(len(data)); frames are cut from the front
        at = 0
        try:
            while len(buf) - at >= 4:
                size = int.from_bytes(buf[at : at + 4], "little")
                if size > MAX_BODY:
                    self._refuse(
                        InvalidRequest(f"frame: {size} B > {MAX_BODY}"), "frame_size"
                    )
                    return
                if len(buf) - at - 4 < size:
                    break
                self._dispatch(bytes(buf[at + 4 : at + 4 + size]))
                at += 4 + size
        except Exception:  # a broken connection must not take the server down
            logger.exception("fast-path connection failed")
            self._transport.close()
            return
        if at:
            del buf[:at]
            self._account()
        self._charge(len(buf))
        self._time_frame(restart=at > 0 or len(buf) == len(data))
        if self._shared.buffered > RECEIVE_BUDGET and buf:
            self._refuse(
                Overloaded(
                    f"frame: {self._shared.buffered} B of partial frames are "
                    f"buffered over all connections (at most {RECEIVE_BUDGET})"
                ),
                "partial_frames",
            )

    def eof_received(self) -> bool:
        """The engine is done sending; answer what is queued, then close. A
        client that closed its end altogether reads no answer: what it queued
        is dropped (_drain)."""
        self._eof = True
        self._hung_up = hung_up(self._transport.get_extra_info("socket"))
        return self._task is not None  # True keeps the transport open for now

    def _dispatch(self, body: bytes) -> None:
        if self._discard or self._transport.is_closing():
            return
        if not self._greeted:
            self._hello(body)
            return
        owes = reply_bound(body)
        charge = len(body) + owes
        lone = not (self._queued or self._transport.get_write_buffer_size())
        if not (lone and charge <= LONE_BYTES) and self._over_budget(charge):
            self._overloaded(charge)
            return
        if not self._queued and body[:1] == bytes([QUERY]):
            reply = self._query(body)
            if isinstance(reply, bytes):
                self._reply(reply)
                return
            body = reply  # it waits for the metaserver: answered in order below
        self._queued.append(body)
        self._owed += owes
        if isinstance(body, bytes):
            self._queued_bytes += len(body)
        self._flow()
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())

    def _reply(self, reply: bytes) -> None:
        self._transport.write(reply)
        self._written += len(reply)
        if self._unread_timer is None and self._transport.get_write_buffer_size():
            self._watch_unread(self._sent())

    def _sent(self) -> int:
        """Reply bytes that left the transport's buffer (for the kernel's)."""
        return self._written - self._transport.get_write_buffer_size()

    def _watch_unread(self, sent: int) -> None:
        loop = asyncio.get_running_loop()
        self._unread_timer = loop.call_later(
            UNREAD_TIMEOUT_S, self._unread_expired, sent
        )

    def _unread_expired(self, sent_then: int) -> None:
        self._unread_timer = None
        transport = self._transport
        if (
            self._lost
            or transport.is_closing()
            or not transport.get_write_buffer_size()
        ):
            return
        if self._sent() > sent_then:  # read meanwhile, only slowly: watch on
            self._watch_unread(self._sent())
            return
        logger.info(
            "fast-path connection closed: its replies went unread for %g s",
            UNREAD_TIMEOUT_S,
        )
        self._metrics.socket_refusals.labels("unread").inc()
        transport.abort()  # no error reply: it would wait behind the unread ones

    def _account(self) -> None:
        """Charge the shared backlog with this connection's."""
        size = 0
        if not self._lost:
            size = self._queued_bytes + self._owed
            size += self._transport.get_write_buffer_size()
        shared = self._shared
        shared.backlog += size - self._backlog
        self._backlog = size
        (shared.backlogged.add if size else shared.backlogged.discard)(self)

    def _over_budget(self, more: int) -> bool:
        """Whether `more` bytes would take the backlog past BACKLOG_BUDGET
        while something else is charged (see there)."""
        self._account()
        shared = self._shared
        if shared.backlog + more > BACKLOG_BUDGET:
            for conn in list(shared.backlogged):  # replies sent since counted
                conn._account()
        return shared.backlog > 0 and shared.backlog + more > BACKLOG_BUDGET

    def _overloaded(self, more: int) -> None:
        backlog = self._shared.backlog
        wait = f"{backlog} B of requests and replies wait over all connections"
        wait += f" (at most {BACKLOG_BUDGET})"
        if self._queued or self._transport.get_write_buffer_size():
            why = f"{wait}; read each reply before sending the next request"
            self._refuse(Overloaded(f"connection: {why}"), "backlog")  # pipelined
            return
        self._metrics.socket_refusals.labels("backlog").inc()
        why = f"request: {more} B with the most its reply can take, and {wait}"
        self._reply(error_reply(Overloaded(f"{why}; retry")))

    def pause_writing(self) -> None:
        self._writable = False
        self._can_write.clear()
        self._flow()

    def resume_writing(self) -> None:
        self._writable = True
        self._can_write.set()
        self._flow()

    def _flow(self) -> None:
        """Read while the queue is small and the peer reads its replies."""
        if self._transport.is_closing():
            return
        full = self._queued_bytes > (
            QUEUED_PAUSE_BYTES // 2 if not self._reading else QUEUED_PAUSE_BYTES
        )
        want = self._writable and not full and not self._fd_wait
        if want != self._reading:
            self._reading = want
            (
                self._transport.resume_reading
                if want
                else self._transport.pause_reading
            )()
            self._time_frame(restart=True)  # the rest can come only while read

    def _hello(self, body: bytes) -> None:
        try:
            version = decode_hello(body)
        except PegaflowError as exc:
            self._refuse(exc, "protocol")
            return
        if version != PROTOCOL_VERSION:
            self._refuse(
                ProtocolMismatch(
                    f"hello.version: {version}; this server speaks protocol "
                    f"{PROTOCOL_VERSION}: run the same pegaflow version on both sides"
                ),
                "protocol",
            )
            return
        self._greeted = True
        self._disarm()
        info = self._shared.info
        self._transport.write(HELLO_REPLY.pack(0, PROTOCOL_VERSION, info.server_id))

    async def _drain(self) -> None:
        try:
            while self._queued:
                # The next reply only once the client reads: else each
                # queued request's reply would grow the write buffer.
                await self._can_write.wait()
                if self._gone():
                    self._drop()
                    break
                reply = await self._answer(self._queued[0])
                done = self._queued.popleft()
                self._owed -= (  # a query left waiting owes as its frame did
                    reply_bound(done) if isinstance(done, bytes) else REPLY_ALLOWANCE
                )
                if isinstance(done, bytes):
                    self._queued_bytes -= len(done)
                if not (self._discard or self._transport.is_closing()):
                    self._reply(reply)
                    self._flow()
                self._account()
        finally:
            self._task = None
            if self._eof:
                self._transport.close()

    def _gone(self) -> bool:
        """No one will read the answers: the client closed or was refused."""
        return (
            self._lost or self._discard or self._hung_up or self._transport.is_closing()
        )

    def _drop(self) -> None:
        """Drop the queued requests undone (a save or load would copy for no
        one); one already running finishes first."""
        self._metrics.socket_dropped.inc(len(self._queued))
        self._queued.clear()
        self._queued_bytes = self._owed = 0
        self._account()

    async def _answer(self, body: bytes | QueryResult) -> bytes:
        if isinstance(body, QueryResult):
            return await self._finish_query(body)
        if body[:1] == bytes([SHARE]):
            got = await guarded(self._metrics, "Share", "unix", self._share(body))
            if isinstance(got, FdLost) or self._fd_wait:
                # READY went out but no descriptor was read in turn (or this
                # failed in between): the stream's state is unknown now, and
                # reading stays paused until the connection ends.
                error = got.error if isinstance(got, FdLost) else got
                if not isinstance(error, PegaflowError):
                    error = InternalError("share.fd: the exchange broke off")
                if not (self._discard or self._transport.is_closing()):
                    self._refuse(error, "share")
                return b""
            return error_reply(got) if isinstance(got, PegaflowError) else got
        try:
            kind = kind_of(body)
        except PegaflowError as exc:
            return error_reply(exc)
        if kind == QUERY:
            reply = self._query(body)
            return (
                reply if isinstance(reply, bytes) else await self._finish_query(reply)
            )
        return await self._guarded(kind, body)

    def _query(self, body: bytes) -> bytes | QueryResult:
        """The reply, or a result still waiting for the metaserver."""
        got = guarded_sync(
            self._metrics, "QueryPrefix", "unix", lambda: self._answer_query(body)
        )
        return error_reply(got) if isinstance(got, PegaflowError) else got

    def _answer_query(self, body: bytes) -> bytes | QueryResult:
        ident, hashes, hash_len, deadline_ns = decode_query(body)
        ctx = CallContext(self._caller, b"", deadlines.from_wire(deadline_ns))
        res = self._engine.query(ident, hashes, hash_len, ctx)
        return res if res.pending is not None else query_reply(res)

    async def _finish_query(self, res: QueryResult) -> bytes:
        """Timed apart from the query's first part, which was counted already."""
        got = await guarded(self._metrics, "QueryMetaserver", "unix", res.pending())
        return error_reply(got) if isinstance(got, PegaflowError) else query_reply(got)

    async def _register(self, body: bytes) -> bytes:
        from pegaflow.proto import pegaflow_pb2 as pb

        from .grpc_service import register_response, spec_from_message

        request, deadline_ns = decode_register(body)
        deadlines.check(deadlines.from_wire(deadline_ns), "register")
        try:
            req = pb.RegisterInstanceRequest.FromString(request)
        except Exception:  # protobuf's DecodeError and friends: the client's
            raise InvalidRequest("register: not a RegisterInstanceRequest") from None
        if self._caller.pid == UNKNOWN:
            raise InvalidRequest("register: the kernel named no peer process")
        pid, sock = self._caller.pid, self._transport.get_extra_info("socket")

        def vouch() -> None:
            # SO_PEERCRED's pid is from connect(): a child that kept the
            # connection must not register the memory of whichever process
            # took that pid since (the registration checks the pid's process).
            if peer_exited(sock):
                raise PermissionDenied(
                    f"register: the process that opened this connection (pid "
                    f"{pid}) has exited, and its pid may be another process's "
                    "now; register over a connection of your own"
                )

        vouch()
        spec = spec_from_message(req)
        worker = await self._engine.register_when_ready(spec, self._caller, vouch)
        info = self._shared.info
        response = register_response(worker, info.pid, info.path)
        return register_reply(response.SerializeToString())

    async def _save(self, body: bytes) -> bytes:
        *args, event, deadline_ns, token = decode_save(body)
        ctx = CallContext(self._caller, token, deadlines.from_wire(deadline_ns))
        res = await self._engine.save(*args, event, ctx)
        return SAVE_REPLY.pack(0, res.stored, res.deduplicated, res.rejected)

    async def _load(self, body: bytes) -> bytes:
        *args, done, deadline_ns, token = decode_load(body)
        ctx = CallContext(self._caller, token, deadlines.from_wire(deadline_ns))
        # A copy failing after its answer hangs up: the engine's wait sees it.
        hang_up = self._transport.abort
        got = await self._engine.load(*args, ctx, done_event=done, hang_up=hang_up)
        return load_reply(got.loaded, got.bytes, got.items, got.in_flight)

    async def _guarded(self, kind: int, body: bytes) -> bytes:
        """As gRPC's interceptor does (pegaflow.daemon.boundary)."""
        work = {REGISTER: self._register, SAVE: self._save}.get(kind, self._load)(body)
        got = await guarded(self._metrics, _METHODS[kind], "unix", work)
        return error_reply(got) if isinstance(got, PegaflowError) else got

    async def _share(self, body: bytes) -> bytes | FdLost:
        """pegaflow.server.socket_share, with this connection's descriptor
        reading paused and resumed around it."""

        def pause(paused: bool) -> None:
            self._fd_wait = paused
            self._flow()

        return await share(self._engine, self._caller, body, self._transport, pause)


_METHODS = {SAVE: "Save", LOAD: "Load", REGISTER: "RegisterInstance"}


async def start_socket_server(
    path: str, engine: Engine, info: SocketServerInfo
) -> asyncio.AbstractServer:
    """Serve the socket's frames on `path` (mode 0600 from creation: the
    server's user only; pegaflow.server.socket_file refuses a path that is not a stale
    socket of ours)."""
    sock = bind_private_unix(path)
    loop = asyncio.get_running_loop()
    shared = _Shared(engine, info)
    try:
        return await loop.create_unix_server(lambda: _SocketProtocol(shared), sock=sock)
    except BaseException:
        unlink_if_ours(path, sock)
        sock.close()
        raise
