"""The HTTP port cannot be used to exhaust the server: before, every
connection got a thread with no timeout, and 300 half-sent requests held 300
threads (and descriptors, shared with the gRPC port, the socket and the SSD
files) for good. Now at most 32 are served at once, each with 5 s to send its
request, and /health answers again once the idle ones are dropped."""

from __future__ import annotations

import socket
import time

import pytest

from tests.procs import start_server


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise AssertionError("no Threads line")


@pytest.mark.timeout(120)
def test_idle_http_connections_are_bounded_and_dropped(tmp_path) -> None:
    server = start_server(tmp_path, "--pool-size", "16mb")
    socks: list[socket.socket] = []
    try:
        host, port = server.http.rsplit(":", 1)
        before = _threads(server.pid)
        for _ in range(300):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
        time.sleep(1)
        assert _threads(server.pid) - before <= 32 + 16  # was one per connection
        time.sleep(6)  # past the request timeout: the idle ones are gone
        assert _threads(server.pid) - before <= 16
        assert server.get("/health")[0] == 200
    finally:
        for s in socks:
            s.close()
        server.stop()
