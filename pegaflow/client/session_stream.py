"""An engine worker's liveness stream: while it is open the server keeps the
worker's registration; when it closes (close(), exit, crash, SIGKILL) the
server drops the registration and leases and keeps the cached blocks."""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Iterator

import grpc

from pegaflow.common.errors import PegaflowError, from_status
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc

# Sessions still open, closed at exit (close_open_sessions).
_OPEN: weakref.WeakSet[Session] = weakref.WeakSet()


class Session:
    """Keeps the liveness stream open from a daemon thread; the server drops the
    worker when it closes (close(), process exit or crash)."""

    def __init__(
        self,
        stub: pb_grpc.PegaFlowStub,
        instance_id: str,
        tp_rank: int,
        interval_s: float,
        owner_token: bytes = b"",
    ) -> None:
        self._pings: queue.Queue[pb.SessionPing | None] = queue.Queue()
        self._interval = interval_s
        self._ping = pb.SessionPing(
            instance_id=instance_id, tp_rank=tp_rank, owner_token=owner_token
        )
        self._stream = stub.Session(self._requests())
        self.error: PegaflowError | None = None
        self._first = threading.Event()
        self._thread = threading.Thread(
            target=self._drain, daemon=True, name="pegaflow-session"
        )
        self._thread.start()
        if not self._first.wait(10.0) and self.error is None:
            self.error = from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, "no session reply"
            )
        if self.error is not None:
            raise self.error
        _OPEN.add(self)

    def _requests(self) -> Iterator[pb.SessionPing]:
        yield self._ping
        while True:
            try:
                item = self._pings.get(timeout=self._interval)
            except queue.Empty:
                item = self._ping
            if item is None:
                return
            yield item

    def _drain(self) -> None:
        try:
            for _ in self._stream:
                self._first.set()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.error = from_status(exc.code(), exc.details() or "")
        finally:
            self._first.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        _OPEN.discard(self)
        self._pings.put(None)
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            self._stream.cancel()
            self._thread.join(timeout=1.0)


@atexit.register
def close_open_sessions() -> None:
    """A process that exits without closing its session (a vLLM worker whose
    connector was never shut down) would leave the stream to interpreter
    finalization, where its __del__ can wait forever on a lock one of grpc's
    dying daemon threads holds (a known exit race of grpc's sync streams).
    atexit runs while those threads still live: end the streams here."""
    for session in list(_OPEN):
        session.close()
