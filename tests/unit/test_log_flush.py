"""The server's log lines go through a queue to a writer thread
(pegaflow.server.cli): flushing the handler waits until what was logged is
written, so READY follows the start's lines (a test read the log at READY
and missed "removing stale socket", written 25 ms later), and a stuck
stderr holds it at most FLUSH_S."""

from __future__ import annotations

import io
import logging
import logging.handlers
import queue
import threading
import time

from pegaflow.server import cli


class SlowStream(io.StringIO):
    def __init__(self, delay_s: float, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.delay_s, self.gate = delay_s, gate

    def write(self, text: str) -> int:
        if self.gate is not None:
            self.gate.wait()
        time.sleep(self.delay_s)
        return super().write(text)


def _logger(stream: io.StringIO):
    q: queue.Queue = queue.Queue(cli.LOG_BACKLOG)
    handler = cli._DroppingQueueHandler(q)
    listener = logging.handlers.QueueListener(q, logging.StreamHandler(stream))
    log = logging.getLogger(f"test_log_flush.{id(stream)}")
    log.propagate = False
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    listener.start()
    return log, handler, listener


def test_flush_waits_for_the_lines_logged_before_it() -> None:
    stream = SlowStream(0.2)
    log, handler, listener = _logger(stream)
    try:
        log.info("removing stale socket")
        handler.flush()
        assert "removing stale socket" in stream.getvalue()
    finally:
        listener.stop()


def test_a_stuck_stream_holds_flush_at_most_its_bound() -> None:
    gate = threading.Event()
    stream = SlowStream(0.0, gate)
    log, handler, listener = _logger(stream)
    try:
        log.info("a line stderr never takes")
        start = time.monotonic()
        handler.flush()
        assert time.monotonic() - start < cli.FLUSH_S + 0.5
    finally:
        gate.set()
        listener.stop()
