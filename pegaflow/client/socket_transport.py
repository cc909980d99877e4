"""The engine's side of the server's unix socket (pegaflow.server.socket_service):
blocking, one connection per calling thread (SocketClient), and the Transport
over it that connects on first use and drops a broken connection
(SocketTransport). Frames: pegaflow.common.socket_frames."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from pegaflow.common.errors import PegaflowError, from_status
from pegaflow.common.identity import unix_peer
from pegaflow.common.results import (
    LoadBatchResult,
    LoadItemResult,
    QueryResult,
    SaveResult,
)
from pegaflow.common.share_frames import (
    DONE,
    READY,
    SHARE_DONE,
    SHARE_READY,
    ShareRequest,
    encode_share,
)
from pegaflow.common.socket_frames import (
    HELLO_REPLY,
    IN_FLIGHT,
    LOAD_REPLY,
    LOADING,
    MAX_ERROR_MESSAGE,
    MAX_REPLY,
    PROTOCOL_VERSION,
    QUERY_REPLY,
    REGISTER_REPLY,
    SAVE_REPLY,
    encode_hello,
    encode_load,
    encode_query,
    encode_register,
    encode_save,
    load_reply_size,
    parse_load_reply,
)
from pegaflow.proto import pegaflow_pb2 as pb

from . import busy_poll
from .grpc_transport import LoadCall, QueryCall, SaveCall

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_S = 5.0  # after the socket failed to connect, gRPC alone for this long


class SocketClient:
    """Blocking client of the fast-path socket: one connection per calling
    thread (a worker's save must not hold up its load or a query), one request
    in flight on each. Every connection checks that the server behind the
    socket is the one the client asked over gRPC (its pid from the kernel, its
    random id from the hello), so a socket planted at that path gets nothing."""

    def __init__(
        self,
        path: str,
        timeout_s: float,
        server_id: bytes,
        server_pid: int,
        busy_poll_us: int = 0,
    ) -> None:
        """busy_poll_us: poll for each reply this long before sleeping on it
        (pegaflow.client.busy_poll)."""
        self._path = path
        self._timeout_s = timeout_s
        self._poller = busy_poll.ReplyPoller(busy_poll_us)
        self._server_id = server_id
        self._server_pid = server_pid
        self._local = threading.local()
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        self._conn(first=True)  # fail now when the socket cannot be reached

    def _conn(self, first: bool = False) -> socket.socket:
        """This thread's connection, made on its first call. A server's
        refusal of a later thread's connection (its cap, a hello it timed
        out) is a ConnectionRefusedError: the call falls back to gRPC as for
        a socket gone; the first one's stays typed (the link's `refusal`)."""
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self._timeout_s)
                sock.connect(self._path)
                self._greet(sock)
            except OSError:
                sock.close()
                raise
            except PegaflowError as exc:
                sock.close()
                if first:
                    raise
                raise ConnectionRefusedError(f"{self._path}: {exc}") from exc
            with self._lock:
                if self._closed:
                    sock.close()
                    raise ConnectionError("fast-path client closed")
                self._socks.append(sock)
            self._local.sock = sock
        return sock

    def _greet(self, sock: socket.socket) -> None:
        peer = unix_peer(sock)
        if peer.pid != self._server_pid:
            raise ConnectionRefusedError(
                f"{self._path}: served by pid {peer.pid}, not the server "
                f"(pid {self._server_pid})"
            )
        sock.sendall(encode_hello())
        status, reply = self._read_reply(sock, HELLO_REPLY.size, None)
        _, version, server_id = HELLO_REPLY.unpack(reply)
        if server_id != self._server_id or version != PROTOCOL_VERSION:
            raise ConnectionRefusedError(f"{self._path}: another server's socket")

    def query(self, frame: bytes, wait_s: float) -> QueryResult:
        """Typed exceptions for errors; OSError when the connection is broken,
        TimeoutError when no reply came within wait_s."""
        status, reply = self._exchange(frame, wait_s, QUERY_REPLY.size)
        _, n, lease, ttl, ready, l1, tier = QUERY_REPLY.unpack(reply)
        return QueryResult(n, lease, ttl, status == LOADING, ready, l1, tier)

    def save(self, frame: bytes, wait_s: float) -> tuple[int, int, int]:
        """(stored, deduplicated, rejected)."""
        _, reply = self._exchange(frame, wait_s, SAVE_REPLY.size)
        return SAVE_REPLY.unpack(reply)[1:]

    def load(
        self, frame: bytes, wait_s: float
    ) -> tuple[int, int, list[tuple[int, int, str]], bool]:
        """(loaded, bytes, [(loaded, bytes, error)] per item, in flight)."""
        _, reply = self._exchange(frame, wait_s, LOAD_REPLY.size, load_reply_size)
        return parse_load_reply(bytes(reply))

    def register(self, frame: bytes, wait_s: float) -> bytes:
        """The serialised RegisterInstanceResponse."""
        _, reply = self._exchange(frame, wait_s, REGISTER_REPLY.size, _register_size)
        return bytes(reply[REGISTER_REPLY.size :])

    def share(self, frame: bytes, fd: int, wait_s: float) -> int:
        """Hand the server a memfd (pegaflow.common.share_frames): the frame,
        its READY, then the descriptor on one byte. The bytes it mapped."""
        sock = self._conn()
        try:
            sock.settimeout(max(wait_s, 1e-3))
            sock.sendall(frame)
            _, reply = self._read_reply(sock, SHARE_READY.size, None)
            if SHARE_READY.unpack_from(reply)[1] != READY:
                raise ConnectionError("share: the server answered out of turn")
        except OSError:  # half an exchange may be left in it
            self._forget(sock)
            raise
        try:
            socket.send_fds(sock, [b"\0"], [fd])
            _, reply = self._read_reply(sock, SHARE_DONE.size, None)
        except (OSError, PegaflowError):  # a refusal here may close it
            self._forget(sock)
            raise
        _, step, nbytes = SHARE_DONE.unpack_from(reply)
        if step != DONE:
            self._forget(sock)
            raise ConnectionError("share: the server answered out of turn")
        return nbytes

    def _exchange(
        self,
        frame: bytes,
        wait_s: float,
        ok_size: int,
        full_size: Callable[[bytearray], int] | None = None,
    ) -> tuple[int, bytearray]:
        sock = self._conn()
        # With busy polling, the request's kind and size class: a 1-block
        # save is answered in ~0.4 ms, a 64-block one in ~3.5 (H100 host).
        kind = (frame[4], len(frame).bit_length()) if self._poller.on else None
        try:
            sock.settimeout(max(wait_s, 1e-3))
            sent = time.perf_counter_ns()
            sock.sendall(frame)
            got = self._read_reply(sock, ok_size, full_size, kind, sent)
            if kind is not None:
                self._poller.took(kind, time.perf_counter_ns() - sent)
            return got
        except OSError:  # an error reply leaves the connection usable
            self._forget(sock)  # half a reply may be left in it
            raise

    def _read_reply(
        self,
        sock: socket.socket,
        ok_size: int,
        full_size: Callable[[bytearray], int] | None,
        kind: object = None,
        sent_ns: int = 0,
    ) -> tuple[int, bytearray]:
        """kind: the request's, for busy polling (None: no polling), sent at
        sent_ns (time.perf_counter_ns())."""
        # Every reply is at least 5 bytes and the only one in flight on
        # this connection: the first recv (4 KiB) usually takes it whole.
        if kind is not None:
            self._poller.wait(sock.fileno(), kind, sent_ns)
        reply = self._recv(sock, 5, bytearray())
        status = reply[0]
        if status in (0, LOADING, IN_FLIGHT):
            reply = self._recv(sock, ok_size, reply)
            while full_size is not None and len(reply) < (n := full_size(reply)):
                if n > MAX_REPLY:  # a lying length: read no further
                    raise ConnectionError(
                        f"fast-path reply: {n} B long, at most {MAX_REPLY}: "
                        "not a reply of this protocol"
                    )
                reply = self._recv(sock, n, reply)
            return status, reply
        length = int.from_bytes(reply[1:5], "little")
        if length > MAX_ERROR_MESSAGE:  # a lying length: read no further
            raise ConnectionError(
                f"fast-path reply: an error message of {length} B, at most "
                f"{MAX_ERROR_MESSAGE}: not a reply of this protocol"
            )
        message = self._recv(sock, 5 + length, reply)[5:].decode(errors="replace")
        code = next((c for c in grpc.StatusCode if c.value[0] == status), None)
        raise from_status(code or grpc.StatusCode.UNKNOWN, message)

    @staticmethod
    def _recv(sock: socket.socket, n: int, buf: bytearray) -> bytearray:
        """Read until buf holds n bytes (recv allocates what it is asked
        for: a reply of megabytes is read a MiB at a time)."""
        while len(buf) < n:
            chunk = sock.recv(min(max(n - len(buf), 4096), 1 << 20))
            if not chunk:
                raise ConnectionError("fast-path socket closed by the server")
            buf += chunk
        return buf

    def _forget(self, sock: socket.socket) -> None:
        self._local.sock = None
        with self._lock:
            if sock in self._socks:
                self._socks.remove(sock)
        sock.close()

    def thread_fd(self) -> int:
        """This thread's connection (its last request went out on it), -1
        while it has none."""
        sock = getattr(self._local, "sock", None)
        return -1 if sock is None else sock.fileno()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


def _register_size(reply: bytearray) -> int:
    return REGISTER_REPLY.size + REGISTER_REPLY.unpack_from(reply)[1]


class SocketTransport:
    """pegaflow.client.grpc_transport.Transport over the server's unix socket, connected
    on first use to the socket that the server gRPC reaches names in its
    ServerInfo. It answers None while it has no connection: the server serves
    no socket, or it is out of reach (another host or user; asked again
    RETRY_S later, as the server may have restarted meanwhile). A connection
    that breaks is dropped and raises OSError; one with no answer in time is
    dropped and raises the typed timeout error."""

    def __init__(
        self,
        server_info: Callable[[], pb.ServerInfoResponse],
        timeout_s: float,
        busy_poll_us: int = 0,
    ) -> None:
        self._ask = server_info  # gRPC's ServerInfo
        self._timeout_s = timeout_s
        self._busy_poll_us = busy_poll_us
        self.server: pb.ServerInfoResponse | None = None  # whom it must reach
        self._frames: SocketClient | None = None
        self._retry_at = 0.0
        # The server's own refusal of its socket (full: RESOURCE_EXHAUSTED),
        # the real cause when gRPC then refuses what only the socket carries.
        self.refusal: PegaflowError | None = None

    @property
    def connected(self) -> bool:
        return self._frames is not None

    def thread_fd(self) -> int:
        """SocketClient.thread_fd; -1 without a connection."""
        return -1 if self._frames is None else self._frames.thread_fd()

    def follow(self, info: pb.ServerInfoResponse) -> None:
        """The server gRPC reaches now: restarted, it has another socket."""
        if self.server is None or info.server_id != self.server.server_id:
            self.close()
        self.server = info

    def register(
        self, request: pb.RegisterInstanceRequest, deadline_ns: int, wait_s: float
    ) -> pb.RegisterInstanceResponse | None:
        frame = encode_register(request.SerializeToString(), deadline_ns)
        got = self._send(frame, lambda s, f: s.register(f, wait_s))
        return None if got is None else pb.RegisterInstanceResponse.FromString(got)

    def save(self, call: SaveCall) -> SaveResult | None:
        frame = encode_save(
            call.instance_id,
            call.tp_rank,
            call.block_ids,
            call.hashes,
            call.layer_ids,
            call.wait_event,
            call.deadline_ns,
            call.token,
        )
        got = self._send(frame, lambda s, f: s.save(f, call.wait_s))
        return None if got is None else SaveResult(*got)

    def query(self, call: QueryCall) -> QueryResult | None:
        frame = encode_query(
            call.instance_id, call.hashes, call.hash_len, call.deadline_ns
        )
        return self._send(frame, lambda s, f: s.query(f, call.wait_s))

    def load(self, call: LoadCall) -> LoadBatchResult | None:
        frame = encode_load(
            call.instance_id,
            call.tp_rank,
            call.items,
            call.batch,
            call.layer_seq,
            call.deadline_ns,
            call.token,
            call.done_event,
        )
        got = self._send(frame, lambda s, f: s.load(f, call.wait_s))
        if got is None:
            return None
        loaded, nbytes, items, in_flight = got
        if len(items) != len(call.items):
            raise PegaflowError(
                f"Load: {len(items)} item results for {len(call.items)}"
            )
        return LoadBatchResult(
            loaded, nbytes, tuple(LoadItemResult(*item) for item in items), in_flight
        )

    def share(self, request: ShareRequest, fd: int, wait_s: float) -> int | None:
        """The bytes the server mapped; None without a socket (the memory
        stays on the process_vm path)."""
        frame = encode_share(request)
        return self._send(frame, lambda s, f: s.share(f, fd, wait_s))

    def close(self) -> None:
        """Drop the connection; the next call connects again."""
        if self._frames is not None:
            self._frames.close()
            self._frames = None

    def _send(
        self, frame: bytes | None, exchange: Callable[[SocketClient, bytes], T]
    ) -> T | None:
        if frame is None:
            return None
        frames = self.connection()
        if frames is None:
            return None
        try:
            return exchange(frames, frame)
        except TimeoutError:  # no answer even after the grace
            self.close()
            raise from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no answer on the socket"
            ) from None
        except OSError:  # server gone or restarted: the client falls back
            self.close()
            raise

    def connection(self) -> SocketClient | None:
        """The frame client, connected on first use; None while there is none."""
        if self._frames is not None or time.monotonic() < self._retry_at:
            return self._frames
        try:
            info = self.server
            if info is None:
                info = self._ask()
                self.follow(info)
            if info.socket_path:
                self.refusal = None
                try:
                    self._frames = SocketClient(
                        info.socket_path, self._timeout_s, info.server_id,
                        info.server_pid, self._busy_poll_us,
                    )  # fmt: skip
                except PegaflowError as exc:  # the server answered: a refusal
                    self.refusal = exc
                    raise
        except (OSError, PegaflowError) as exc:  # another host, user, or gone
            logger.debug("server socket unusable: %s", exc)
            self.server = None  # ask the server again next time
            self._retry_at = time.monotonic() + RETRY_S
        return self._frames
