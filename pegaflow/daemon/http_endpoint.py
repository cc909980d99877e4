"""HTTP endpoint: /health (JSON), /metrics (Prometheus text) and further JSON
routes (/stats), for the server and the metaserver.

One thread reads every connection (non-blocking, one selector), so a client
that trickles its request costs a descriptor and a buffer, never a thread:
with a thread per connection, 900 clients sending a byte every 2 s held all
32 threads for good and /health, the liveness probe, went unanswered. Now:

- a request line and headers must arrive within HEADER_DEADLINE_S of the
  connect, however slowly they trickle; the answer must be taken within
  ANSWER_DEADLINE_S of the request;
- at most MAX_CONNECTIONS are open; one more drops the connection that has
  waited longest for its own request to arrive (a prober sends its request
  at once, so it is never the oldest of the trickling ones);
- /health is answered on that thread (counts only, microseconds); /metrics
  and routes run on WORKERS threads, at most MAX_QUEUED waiting (more: 503).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import selectors
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

# Descriptors are shared with the gRPC port, the socket and the SSD files.
MAX_CONNECTIONS = 128
HEADER_DEADLINE_S = 5.0
ANSWER_DEADLINE_S = 10.0  # /stats may wait up to 5 s for the event loop
MAX_HEAD_BYTES = 16 << 10  # request line and headers; more is refused (431)
WORKERS = 2
MAX_QUEUED = 16  # /metrics and routes waiting for a worker
_TICK_S = 0.25  # how late a deadline may be acted on

Respond = Callable[[bytes], bytes]  # a request head -> the whole answer


class _Conn:
    __slots__ = ("sock", "addr", "deadline", "head", "out", "reading", "events")

    def __init__(self, sock: socket.socket, addr: tuple, now: float) -> None:
        self.sock, self.addr = sock, addr
        self.deadline = now + HEADER_DEADLINE_S
        self.head = bytearray()
        self.out: memoryview | None = None
        self.reading = True  # still waiting for its request head
        self.events = 0  # what the selector watches it for


class HttpEndpoint(socketserver.TCPServer):
    """Bound and listening once built; serves once serve_http gave it its
    routes. shutdown() and server_close() as socketserver's."""

    allow_reuse_address = True
    # The accept loop waits for the GIL behind the event loop: a burst of
    # connections past a backlog of 5 waits out SYN retries (1 s).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int]) -> None:
        # Before the bind: a failed bind calls server_close, which closes these.
        self._sel = selectors.DefaultSelector()
        self._conns: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._waker_r, self._waker_w = socket.socketpair()
        self._waker_r.setblocking(False)
        self._waker_w.setblocking(False)
        self._done: queue.SimpleQueue[tuple[_Conn, bytes]] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="http-work")
        self._queued = 0  # submitted to the pool and not yet answered
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()
        self._respond: Respond | None = None
        super().__init__(address, BaseHTTPRequestHandler)
        self.socket.setblocking(False)

    @property
    def connections(self) -> int:
        return len(self._conns)

    def serve(self, respond: Respond) -> None:
        self._respond = respond
        self._stopped.clear()
        threading.Thread(target=self._run, name="http", daemon=True).start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake()
        self._stopped.wait(10)

    def server_close(self) -> None:
        super().server_close()
        for conn in list(self._conns.values()):
            self._close(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sel.close()
        self._waker_r.close()
        self._waker_w.close()

    # -- the I/O thread --------------------------------------------------------
    def _run(self) -> None:
        sel = self._sel
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._waker_r, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                for key, mask in sel.select(_TICK_S):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._waker_r:
                        self._drain_done()
                    elif key.data.sock in self._conns:  # not closed this round
                        self._io(key.data, mask)
                self._expire(time.monotonic())
        except Exception:  # a boundary: a bug here must not pass silently
            logger.exception("http endpoint stopped")
        finally:
            with contextlib.suppress(Exception):
                sel.unregister(self.socket)
                sel.unregister(self._waker_r)
            self._stopped.set()

    def _accept(self) -> None:
        for _ in range(64):  # then let the others be read
            try:
                sock, addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE: free one of ours, then retry
                logger.debug("http: accept failed: %s", exc)
                self._evict()
                return
            if len(self._conns) >= MAX_CONNECTIONS and not self._evict():
                sock.close()  # every slot is answering: they end by deadline
                continue
            sock.setblocking(False)
            conn = _Conn(sock, addr, time.monotonic())
            self._conns[sock] = conn
            self._watch(conn, selectors.EVENT_READ)

    def _evict(self) -> bool:
        """Drop the connection that has waited longest for its request."""
        for conn in self._conns.values():  # in connect order
            if conn.reading:
                logger.debug("http: %s dropped: no slot, request unsent", conn.addr)
                self._close(conn)
                return True
        return False

    def _io(self, conn: _Conn, mask: int) -> None:
        if conn.reading and mask & selectors.EVENT_READ:
            self._read(conn)
        elif conn.out is not None and mask & selectors.EVENT_WRITE:
            self._write(conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # gone before its request was whole
            self._close(conn)
            return
        start = max(0, len(conn.head) - 3)
        conn.head += data
        end = conn.head.find(b"\r\n\r\n", start)
        if end < 0:
            end = conn.head.find(b"\n\n", start)  # lenient clients
        if end < 0:
            if len(conn.head) > MAX_HEAD_BYTES:
                conn.reading = False
                self._send(conn, _plain(431, b"request head too large\n"))
            return
        conn.reading = False
        conn.deadline = time.monotonic() + ANSWER_DEADLINE_S
        self._watch(conn, 0)  # anything more it sends is not read
        self._dispatch(conn, bytes(conn.head))

    def _dispatch(self, conn: _Conn, head: bytes) -> None:
        first = head.split(b"\r\n", 1)[0].split(b" ")
        path = first[1].split(b"?", 1)[0] if len(first) > 1 else b""
        if path == b"/health":
            self._send(conn, self._answer(head))
            return
        if self._queued >= MAX_QUEUED:
            self._send(conn, _plain(503, b"busy\n"))
            return
        self._queued += 1
        self._pool.submit(self._work, conn, head)

    def _work(self, conn: _Conn, head: bytes) -> None:
        """On a worker: the answer back to the I/O thread."""
        self._done.put((conn, self._answer(head)))
        self._wake()

    def _answer(self, head: bytes) -> bytes:
        try:
            assert self._respond is not None
            return self._respond(head)
        except Exception:  # a boundary: one failed answer must not stop the rest
            logger.exception("http: answer failed")
            return _plain(500, b"internal error\n")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending) or closed
            self._waker_w.send(b"\0")

    def _drain_done(self) -> None:
        with contextlib.suppress(OSError):
            while self._waker_r.recv(4096):
                pass
        while True:
            try:
                conn, answer = self._done.get_nowait()
            except queue.Empty:
                return
            self._queued -= 1
            if conn.sock in self._conns:  # not dropped meanwhile
                self._send(conn, answer)

    def _send(self, conn: _Conn, answer: bytes) -> None:
        conn.out = memoryview(answer)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not len(conn.out):
            self._close(conn)  # HTTP/1.0: one request a connection
        else:
            self._watch(conn, selectors.EVENT_WRITE)

    def _watch(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if not events:
            self._sel.unregister(conn.sock)
        elif conn.events:
            self._sel.modify(conn.sock, events, conn)
        else:
            self._sel.register(conn.sock, events, conn)
        conn.events = events

    def _expire(self, now: float) -> None:
        late = [c for c in self._conns.values() if c.deadline <= now]
        for conn in late:
            logger.debug("http: %s dropped: past its deadline", conn.addr)
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        if conn.events:
            self._sel.unregister(conn.sock)
        conn.sock.close()


def bind_http(host: str, port: int) -> HttpEndpoint:
    """Bind (and listen on) the HTTP address, serving nothing yet: the server
    binds it before the pool comes up, so a port in use fails in milliseconds.
    Raises OSError from bind."""
    return HttpEndpoint((host, port))


def serve_http(
    server: HttpEndpoint,
    registry: CollectorRegistry,
    health: Callable[[], dict[str, object]],
    routes: dict[str, Callable[[], dict[str, object]]] | None = None,
) -> None:
    """Answer on a bound endpoint from its own thread; requests that queued
    in the backlog meanwhile are answered now."""
    routes = routes or {}

    def get(path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(registry)
        if path == "/health":
            report = health()
            status = 200 if report.get("status") == "ok" else 503
            return status, "application/json", json.dumps(report).encode()
        if path in routes:
            body, status = _json(path, routes[path])
            return status, "application/json", body
        return 404, "text/plain", b"not found\n"

    server.serve(lambda head: _handle(head, get))


class _Handler(BaseHTTPRequestHandler):
    """http.server's request parsing and answer writing, over a request head
    already read and into a buffer (the I/O thread sends it)."""

    get: Callable[[str], tuple[int, str, bytes]]

    def __init__(
        self, head: bytes, get: Callable[[str], tuple[int, str, bytes]]
    ) -> None:
        # BaseHTTPRequestHandler.__init__ would read a socket: not called.
        self.rfile, self.wfile = io.BytesIO(head), io.BytesIO()
        self.client_address = ("", 0)
        self.get = get

    def do_GET(self) -> None:  # noqa: N802 - http.server's hook name
        status, ctype, body = self.get(self.path.split("?", 1)[0])
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        logger.debug("http: " + format, *args)


def _handle(head: bytes, get: Callable[[str], tuple[int, str, bytes]]) -> bytes:
    handler = _Handler(head, get)
    handler.handle_one_request()
    return handler.wfile.getvalue()


def _plain(status: int, body: bytes) -> bytes:
    from http import HTTPStatus

    reason = HTTPStatus(status).phrase
    return (
        f"HTTP/1.0 {status} {reason}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def _json(path: str, route: Callable[[], dict[str, object]]) -> tuple[bytes, int]:
    try:
        return json.dumps(route()).encode(), 200
    except Exception:  # a boundary: one failed read must not stop the endpoint
        logger.exception("http %s failed", path)
        return b'{"status": "error"}', 503
