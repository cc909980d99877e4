"""Engine-side client: every call carries a deadline; failures raise the typed
exceptions of pegaflow.errors. Light on purpose: grpcio, protobuf, numpy.

Requests go over the server's unix socket when it is reachable and belongs to
the server asked (pegaflow.client.socket_transport), else over gRPC
(pegaflow.client.grpc_transport); `_carry` is the one place that chooses and
falls back. How each transport
builds its messages, connects and fails lives in those modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pegaflow.common import deadlines
from pegaflow.common.errors import PermissionDenied
from pegaflow.common.geometry import LayerLayout
from pegaflow.common.results import (
    LoadBatchResult,
    LoadItem,
    LoadResult,
    QueryResult,
    Registration,
    SaveResult,
)
from pegaflow.common.share_frames import ShareRequest, ShareSpan
from pegaflow.proto import pegaflow_pb2 as pb

from . import busy_poll
from .block_watch import BlockWatch
from .grpc_transport import GrpcTransport, LoadCall, QueryCall, SaveCall, Transport
from .registration_messages import allow_ptrace_from, cuda_request, host_request
from .session_stream import Session
from .socket_transport import SocketTransport

if TYPE_CHECKING:  # the client never imports CUDA code itself
    from .cuda_export import CudaKVMemory

logger = logging.getLogger(__name__)

# Imported from here by engines (`from pegaflow.client import LoadItem`).
__all__ = ["LoadItem", "PegaflowClient", "Registration", "allow_ptrace_from"]

T = TypeVar("T")
DEFAULT_ADDR = "127.0.0.1:50055"
# After a save's or load's deadline the client still waits this long for the
# server's answer: a copy that started before the deadline finishes (or is
# cut at its next syscall) in that time, so a failure is reported only once
# nothing of the request can still write into the engine's memory.
COPY_GRACE_S = 2.0


class PegaflowClient:
    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        timeout_s: float = 5.0,
        max_message_bytes: int = 8
        << 20,  # the server's (pegaflow.common.request_limits)
        copy_grace_s: float = COPY_GRACE_S,
        busy_poll_us: int = 0,
    ) -> None:
        """busy_poll_us: over the unix socket, poll for each reply this long
        (GIL released) before sleeping on it: lower latency for a busy core
        (pegaflow.client.busy_poll); 0, the default, sleeps at once."""
        self.addr = addr
        self.timeout_s = timeout_s
        self.copy_grace_s = copy_grace_s
        busy_poll.check_busy_poll_us(busy_poll_us, "busy_poll_us")
        if busy_poll_us:
            busy_poll.warm()
        self._grpc = GrpcTransport(addr, max_message_bytes)
        self._socket = SocketTransport(
            lambda: self._grpc.server_info(self.timeout_s), timeout_s, busy_poll_us
        )
        self._socket_wanted = False  # a registration or use_socket() asked for it
        self._socket_off = False  # disable_socket(): gRPC for everything
        # Owner tokens of this client's registrations: (instance_id, tp_rank).
        self._tokens: dict[tuple[str, int], bytes] = {}

    # -- registration -------------------------------------------------------
    def register_host(
        self,
        instance_id: str,
        namespace: str,
        pid: int,
        regions: Sequence[tuple[int, int]],
        layers: Sequence[LayerLayout],
        **options: Any,
    ) -> Registration:
        """Register KV memory of this process in host RAM (pid, address, size).
        options: tp_rank, tp_size, world_size, replicated (every rank holds the
        same KV, MLA: blocks stored once), layer_signals (address of num_layers
        u64 words in this process for layer-wise loads); see
        pegaflow.client.registration_messages.host_request."""
        req = host_request(instance_id, namespace, pid, regions, layers, **options)
        return self._register(req)

    def register_cuda(
        self,
        instance_id: str,
        namespace: str,
        kv: CudaKVMemory,
        event_handles: Sequence[bytes] = (),
        **options: Any,
    ) -> Registration:
        """Register GPU KV memory: `kv` from pegaflow.client.cuda_export.export_kv, and
        the handles of its IpcEvents (saves then pass `wait_event`); options as
        register_host's."""
        req = cuda_request(instance_id, namespace, kv, event_handles, **options)
        return self._register(req)

    def _register(self, req: pb.RegisterInstanceRequest) -> Registration:
        """Over the server's unix socket, where the kernel tells it who we are
        (host memory must register there); gRPC when the socket is off or out
        of reach (another host or user), which serves CUDA engines."""
        info = self._server_info()  # after a restart it is another server
        if req.device == "cpu" or req.HasField("layer_signals"):
            # The server reads our memory while registering us: under Yama's
            # ptrace_scope 1 it may only once we named it.
            allow_ptrace_from(info.server_pid)
        key = (req.instance_id, req.tp_rank)
        req.owner_token = self._tokens.get(key, b"")
        self._socket_wanted = True
        deadline_ns = deadlines.to_wire(self.timeout_s)
        resp = self._carry(lambda t: t.register(req, deadline_ns, self.timeout_s))
        self._tokens[key] = resp.owner_token
        return Registration(resp.server_pid, resp.slot_bytes, info.socket_path)

    def share_host(
        self, instance_id: str, tp_rank: int, fd: int, spans: Sequence[ShareSpan]
    ) -> int | None:
        """Hand the server the sealed memfd behind registered host memory
        (pegaflow.client.host_share), over its unix socket only; the bytes it
        mapped, None without a socket. Raises what the server refused."""
        req = ShareRequest(
            instance_id,
            tp_rank,
            tuple(spans),
            deadlines.to_wire(self.timeout_s),
            self._token(instance_id, tp_rank),
        )
        return self._socket.share(req, fd, self.timeout_s)

    def _server_info(self) -> pb.ServerInfoResponse:
        info = self._grpc.server_info(self.timeout_s)
        self._socket.follow(info)  # a restarted server: another socket
        return info

    def connection_fd(self) -> int:
        """The server socket connection this thread's requests go out on (-1:
        none, gRPC carries them): a load answered in flight watches it, as the
        server ends it when that copy fails (IpcEvents.wait's hang_up_fd)."""
        return self._socket.thread_fd()

    def _token(self, instance_id: str, tp_rank: int) -> bytes:
        return self._tokens.get((instance_id, tp_rank), b"")

    # -- data path ----------------------------------------------------------
    def save(
        self,
        instance_id: str,
        block_ids: Sequence[int] | np.ndarray,
        block_hashes: Sequence[bytes],
        tp_rank: int = 0,
        layer_ids: Sequence[int] | None = None,
        wait_event: int = 0,
    ) -> SaveResult:
        """wait_event: GPU workers, IpcEvents.record()'s value: the server's copy
        waits on the GPU for that event instead of the engine syncing first.
        A save is idempotent: after a broken socket, gRPC repeats it."""
        call = SaveCall(
            instance_id,
            tp_rank,
            np.asarray(block_ids),
            list(block_hashes),
            tuple(layer_ids or ()),
            wait_event,
            self._token(instance_id, tp_rank),
            deadlines.to_wire(self.timeout_s),
            self.timeout_s + self.copy_grace_s,
        )
        return self._carry(lambda t: t.save(call))

    def query(
        self,
        instance_id: str,
        block_hashes: Sequence[bytes],
        hash_len: int | None = None,
    ) -> QueryResult:
        """Longest cached prefix. hash_len: every hash's length, when the caller
        knows them equal (vLLM's are): the socket then skips checking each."""
        call = QueryCall(
            instance_id,
            list(block_hashes),
            hash_len,
            deadlines.to_wire(self.timeout_s),
            self.timeout_s,
        )
        return self._carry(lambda t: t.query(call))

    def load(
        self,
        instance_id: str,
        lease_id: int,
        block_ids: Sequence[int] | np.ndarray,
        tp_rank: int = 0,
        lease_offset: int = 0,
        layer_seq: int = 0,
        done_event: int = 0,
    ) -> LoadResult:
        """layer_seq != 0: the server copies layer by layer and writes it to
        this worker's layer signal word of each layer as that layer lands.
        done_event (a GPU worker's, IpcEvents.load_event()): the server may
        answer as soon as the copy is queued, recording that event after it
        (`in_flight`); the blocks are then loaded once IpcEvents.wait says so."""
        items = [(lease_id, lease_offset, np.asarray(block_ids))]
        got = self._load(instance_id, tp_rank, items, False, layer_seq, done_event)
        return LoadResult(got.loaded, got.bytes, got.in_flight)

    def load_many(
        self,
        instance_id: str,
        items: Sequence[LoadItem],
        tp_rank: int = 0,
        layer_seq: int = 0,
        done_event: int = 0,
    ) -> LoadBatchResult:
        """Every item in one request and one copy on the server. A malformed
        item fails the call (InvalidRequest naming items[i]); an item whose
        lease is gone comes back with `error` set while the others load."""
        specs = [
            (it.lease_id, it.lease_offset, np.asarray(it.block_ids)) for it in items
        ]
        return self._load(instance_id, tp_rank, specs, True, layer_seq, done_event)

    def _load(
        self,
        instance_id: str,
        tp_rank: int,
        specs: list,
        batch: bool,
        seq: int,
        done_event: int = 0,
    ) -> LoadBatchResult:
        """After a broken socket gRPC repeats the load: its lease may be
        consumed by then, and the error says so (vLLM recomputes those)."""
        call = LoadCall(
            instance_id,
            tp_rank,
            specs,
            batch,
            seq,
            self._token(instance_id, tp_rank),
            deadlines.to_wire(self.timeout_s),
            self.timeout_s + self.copy_grace_s,
            done_event,
        )
        return self._carry(lambda t: t.load(call))

    # -- choosing the transport ---------------------------------------------
    def _carry(self, op: Callable[[Transport], T | None]) -> T:
        """The socket first, when wanted; gRPC when it cannot carry the request
        or broke. No answer in time is a failure, not a fallback."""
        if self._socket_wanted and not self._socket_off:
            try:
                got = op(self._socket)
            except OSError as exc:  # server gone or restarted: gRPC decides
                logger.debug("server socket failed (%s); using gRPC", exc)
            else:
                if got is not None:
                    return got
        try:
            return op(self._grpc)
        except PermissionDenied as exc:  # e.g. host memory, which needs the socket
            if self._socket.refusal is not None:  # the real cause: the socket's
                raise self._socket.refusal from exc
            raise

    def use_socket(self) -> None:
        """Send queries over the server's unix socket from now on (gRPC stays
        the fallback); for clients that never register, e.g. vLLM's
        scheduler. The server's own ServerInfo answer names the socket."""
        self._socket_wanted = True

    def disable_socket(self) -> None:
        """gRPC for every call from now on (registration of host memory
        included, which the server refuses over TCP by default)."""
        self._socket_off = True
        self._socket.close()

    # -- the rest (gRPC only) -----------------------------------------------
    def release_lease(self, lease_id: int) -> None:
        self._grpc.release_lease(lease_id, self.timeout_s)

    def unregister(self, instance_id: str, tp_rank: int = 0) -> None:
        token = self._token(instance_id, tp_rank)
        self._grpc.unregister(instance_id, tp_rank, token, self.timeout_s)
        self._tokens.pop((instance_id, tp_rank), None)

    def health(self, timeout_s: float | None = None) -> bool:
        return self._grpc.health(timeout_s or self.timeout_s)

    def open_session(
        self, instance_id: str, tp_rank: int = 0, interval_s: float = 5.0
    ) -> Session:
        token = self._token(instance_id, tp_rank)
        return self._grpc.session(instance_id, tp_rank, interval_s, token)

    def watch_blocks(self, instance_id: str) -> BlockWatch:
        """The block events of the instance's namespace, for KV-aware routers
        (pegaflow.client.block_watch); the instance's user may ask."""
        return BlockWatch(self._grpc.stub, instance_id)

    def close(self) -> None:
        self._socket.close()
        self._grpc.close()

    def __enter__(self) -> PegaflowClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
