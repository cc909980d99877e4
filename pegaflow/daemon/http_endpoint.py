"""HTTP endpoint: /health (JSON), /metrics (Prometheus text) and further JSON
routes (/stats)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger(__name__)

# Connections served at once, and how long one may take to send its request or
# read its answer: a thread and a descriptor each, shared with the gRPC port,
# the socket and the SSD files. Idle or trickling clients (slowloris) must not
# hold them for good; one past the cap is closed at once.
MAX_CONNECTIONS = 32
REQUEST_TIMEOUT_S = 5.0


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The accept loop waits for the GIL behind the event loop: a burst of
    # connections past socketserver's backlog of 5 waits out SYN retries (1 s).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(
        self, request: socket.socket, client_address: object
    ) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def bind_http(host: str, port: int) -> ThreadingHTTPServer:
    """Bind (and listen on) the HTTP address, serving nothing yet: the server
    binds it before the pool comes up, so a port in use fails in milliseconds.
    Raises OSError from bind."""
    return BoundedHTTPServer((host, port), BaseHTTPRequestHandler)


def serve_http(
    server: ThreadingHTTPServer,
    registry: CollectorRegistry,
    health: Callable[[], dict[str, object]],
    routes: dict[str, Callable[[], dict[str, object]]] | None = None,
) -> None:
    """Answer on a bound server from a daemon thread; requests that queued in
    the backlog meanwhile are answered now."""
    routes = routes or {}

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # on the connection's every read and write

        def do_GET(self) -> None:  # noqa: N802 - http.server's hook name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, status = (
                    generate_latest(registry),
                    CONTENT_TYPE_LATEST,
                    200,
                )
            elif path == "/health":
                report = health()
                status = 200 if report.get("status") == "ok" else 503
                body, ctype = json.dumps(report).encode(), "application/json"
            elif path in routes:
                body, status = _json(path, routes[path])
                ctype = "application/json"
            else:
                body, ctype, status = b"not found\n", "text/plain", 404
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            logger.debug("http: " + format, *args)

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()


def _json(path: str, route: Callable[[], dict[str, object]]) -> tuple[bytes, int]:
    try:
        return json.dumps(route()).encode(), 200
    except Exception:  # a boundary: one failed read must not stop the endpoint
        logger.exception("http %s failed", path)
        return b'{"status": "error"}', 503
