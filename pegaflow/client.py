"""Engine-side client: every call carries a deadline; failures raise the typed
exceptions of pegaflow.errors. Light on purpose: grpcio, protobuf, numpy."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pegaflow import deadlines
from pegaflow.errors import PegaflowError, from_status
from pegaflow.fastpath import FastPathClient
from pegaflow.frames import encode_load, encode_query, encode_register, encode_save
from pegaflow.layout import LayerLayout
from pegaflow.proto import pegaflow_pb2 as pb
from pegaflow.proto import pegaflow_pb2_grpc as pb_grpc
from pegaflow.results import (
    LoadBatchResult,
    LoadItemResult,
    LoadResult,
    QueryResult,
    SaveResult,
)

if TYPE_CHECKING:  # the client never imports CUDA code itself
    from pegaflow.cuda_export import CudaKVMemory

logger = logging.getLogger(__name__)

DEFAULT_ADDR = "127.0.0.1:50055"
PR_SET_PTRACER = 0x59616D61
# After a save's or load's deadline the client still waits this long for the
# server's answer: a copy that started before the deadline finishes (or is
# cut at its next syscall) in that time, so a failure is reported only once
# nothing of the request can still write into the engine's memory.
COPY_GRACE_S = 2.0
SOCKET_RETRY_S = 5.0  # after the socket failed, gRPC alone for this long


@dataclass(frozen=True, slots=True)
class Registration:
    server_pid: int
    slot_bytes: int
    query_socket: str = ""


@dataclass(frozen=True, slots=True)
class LoadItem:
    """Leased blocks [lease_offset, lease_offset + len(block_ids)) into these
    engine blocks; one per request in a batched load."""

    lease_id: int
    block_ids: Sequence[int] | np.ndarray
    lease_offset: int = 0


def allow_ptrace_from(pid: int) -> None:
    """Let the server read/write our KV memory where Yama restricts ptrace."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to allow
        logger.debug("prctl(PR_SET_PTRACER) unavailable")


class PegaflowClient:
    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        timeout_s: float = 5.0,
        max_message_bytes: int = 8 << 20,  # the server's (pegaflow.limits)
        copy_grace_s: float = COPY_GRACE_S,
    ) -> None:
        self.addr = addr
        self.timeout_s = timeout_s
        self.copy_grace_s = copy_grace_s
        self._channel = grpc.insecure_channel(
            addr,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = pb_grpc.PegaFlowStub(self._channel)
        self._fast: FastPathClient | None = None
        self._fast_path = ""  # the server's socket, once known; "": gRPC only
        self._socket_off = False  # disable_socket(): gRPC for everything
        self._socket_retry_at = 0.0
        self._server: pb.ServerInfoResponse | None = None  # who the socket must be
        # Owner tokens of this client's registrations: (instance_id, tp_rank).
        self._tokens: dict[tuple[str, int], bytes] = {}

    def _call(
        self, method: str, request: object, timeout_s: float | None = None
    ) -> object:
        try:
            return getattr(self._stub, method)(
                request, timeout=timeout_s or self.timeout_s
            )
        except grpc.RpcError as exc:
            raise from_status(exc.code(), exc.details() or "") from None

    def register_host(
        self,
        instance_id: str,
        namespace: str,
        pid: int,
        regions: Sequence[tuple[int, int]],
        layers: Sequence[LayerLayout],
        tp_rank: int = 0,
        tp_size: int = 1,
        world_size: int | None = None,
        replicated: bool = False,
        layer_signals: int = 0,
    ) -> Registration:
        """Register KV memory in this host's CPU RAM (pid, address, size).
        replicated: every rank holds the same KV (MLA); blocks stored once.
        layer_signals: address of num_layers u64 words in this process for
        layer-wise loads (load(..., layer_seq=)); 0: none."""
        req = pb.RegisterInstanceRequest(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            world_size=world_size or tp_size,
            device="cpu",
            regions=[
                pb.MemoryRegion(host=pb.HostRegion(pid=pid, address=a, size=n))
                for a, n in regions
            ],
            layers=[_layer_message(layer) for layer in layers],
            replicated=replicated,
            layer_signals=_signals_message(layer_signals),
        )
        return self._register(req)

    def register_cuda(
        self,
        instance_id: str,
        namespace: str,
        kv: CudaKVMemory,
        event_handles: Sequence[bytes] = (),
        tp_rank: int = 0,
        tp_size: int = 1,
        world_size: int | None = None,
        replicated: bool = False,
        layer_signals: int = 0,
    ) -> Registration:
        """Register GPU KV memory: `kv` from pegaflow.cuda_export.export_kv, and
        the handles of its IpcEvents (saves then pass `wait_event`).
        layer_signals: as register_host's (host memory of this process)."""
        req = pb.RegisterInstanceRequest(
            instance_id=instance_id,
            namespace=namespace,
            tp_rank=tp_rank,
            tp_size=tp_size,
            world_size=world_size or tp_size,
            device=kv.device,
            regions=[
                pb.MemoryRegion(
                    cuda=pb.CudaRegion(
                        ipc_handle=r.ipc_handle,
                        offset=r.offset,
                        size=r.size,
                        device_uuid=r.device_uuid,
                    )
                )
                for r in kv.regions
            ],
            layers=[_layer_message(layer) for layer in kv.layers],
            event_handles=list(event_handles),
            replicated=replicated,
            layer_signals=_signals_message(layer_signals),
        )
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
        resp = None
        fast = self._fast_client()
        if fast is not None:
            frame = encode_register(
                req.SerializeToString(), deadlines.to_wire(self.timeout_s)
            )
            raw = self._fast_call(fast.register, frame, self.timeout_s)
            if raw is not None:
                resp = pb.RegisterInstanceResponse.FromString(raw)
        if resp is None:
            resp = self._call("RegisterInstance", req)
        self._tokens[key] = resp.owner_token
        return Registration(resp.server_pid, resp.slot_bytes, resp.query_socket)

    def _server_info(self) -> pb.ServerInfoResponse:
        info = self._call("ServerInfo", pb.ServerInfoRequest())
        if self._server is None or info.server_id != self._server.server_id:
            self._drop_fast_path()  # a restarted server: another socket
        if self._fast is None:
            self._fast_path = "" if self._socket_off else info.socket_path
        self._server = info
        return info

    def _token(self, instance_id: str, tp_rank: int) -> bytes:
        return self._tokens.get((instance_id, tp_rank), b"")

    def _copy_wait_s(self) -> float:
        """How long a save or load waits for the answer: see COPY_GRACE_S."""
        return self.timeout_s + self.copy_grace_s

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
        Over the server's unix socket when it has one (a save is idempotent:
        after a broken connection, gRPC repeats it)."""
        token = self._token(instance_id, tp_rank)
        deadline_ns = deadlines.to_wire(self.timeout_s)
        fast = self._fast_client()
        if fast is not None:
            frame = encode_save(
                instance_id,
                tp_rank,
                block_ids,
                list(block_hashes),
                layer_ids or (),
                wait_event,
                deadline_ns,
                token,
            )
            if frame is not None:
                res = self._fast_call(fast.save, frame, self._copy_wait_s())
                if res is not None:
                    return SaveResult(*res)
        resp = self._call(
            "Save",
            pb.SaveRequest(
                instance_id=instance_id,
                tp_rank=tp_rank,
                block_ids=np.asarray(block_ids, np.uint32).tolist(),
                block_hashes=list(block_hashes),
                layer_ids=list(layer_ids or ()),
                wait_event=wait_event,
                owner_token=token,
                deadline_ns=deadlines.to_wire(self.timeout_s),
            ),
            self._copy_wait_s(),
        )
        return SaveResult(resp.stored, resp.deduplicated, resp.rejected)

    def query(
        self,
        instance_id: str,
        block_hashes: Sequence[bytes],
        hash_len: int | None = None,
    ) -> QueryResult:
        """Longest cached prefix; over the server's unix socket when it has one.
        hash_len: every hash's length, when the caller knows them equal (vLLM's
        are): the socket path then skips checking each one."""
        fast = self._fast_client()
        frame = None
        if fast is not None:
            deadline_ns = deadlines.to_wire(self.timeout_s)
            frame = encode_query(instance_id, list(block_hashes), hash_len, deadline_ns)
        if fast is not None and frame is not None:
            res = self._fast_call(fast.query, frame, self.timeout_s)
            if res is not None:
                return QueryResult(*res)
        resp = self._call(
            "QueryPrefix",
            pb.QueryPrefixRequest(
                instance_id=instance_id, block_hashes=list(block_hashes)
            ),
        )
        if resp.WhichOneof("result") == "loading":
            return QueryResult(resp.loading.num_blocks, 0, loading=True)
        return QueryResult(
            resp.ready.num_blocks, resp.ready.lease_id, resp.ready.lease_ttl_s
        )

    def load(
        self,
        instance_id: str,
        lease_id: int,
        block_ids: Sequence[int] | np.ndarray,
        tp_rank: int = 0,
        lease_offset: int = 0,
        layer_seq: int = 0,
    ) -> LoadResult:
        """layer_seq != 0: the server copies layer by layer and writes it to
        this worker's layer signal word of each layer as that layer lands."""
        fast = self._fast_load(
            instance_id,
            tp_rank,
            [(lease_id, lease_offset, block_ids)],
            False,
            layer_seq,
        )
        if fast is not None:
            return LoadResult(fast.loaded, fast.bytes)
        resp = self._call(
            "Load",
            pb.LoadRequest(
                instance_id=instance_id,
                tp_rank=tp_rank,
                lease_id=lease_id,
                lease_offset=lease_offset,
                block_ids=np.asarray(block_ids, np.uint32).tolist(),
                layer_seq=layer_seq,
                owner_token=self._token(instance_id, tp_rank),
                deadline_ns=deadlines.to_wire(self.timeout_s),
            ),
            self._copy_wait_s(),
        )
        return LoadResult(resp.loaded, resp.bytes)

    def load_many(
        self,
        instance_id: str,
        items: Sequence[LoadItem],
        tp_rank: int = 0,
        layer_seq: int = 0,
    ) -> LoadBatchResult:
        """Every item in one RPC and one copy on the server. A malformed item
        fails the call (InvalidRequest naming items[i]); an item whose lease is
        gone comes back with `error` set while the others load."""
        specs = [(it.lease_id, it.lease_offset, it.block_ids) for it in items]
        fast = self._fast_load(instance_id, tp_rank, specs, True, layer_seq)
        if fast is not None:
            return fast
        resp = self._call(
            "Load",
            pb.LoadRequest(
                instance_id=instance_id,
                tp_rank=tp_rank,
                items=[
                    pb.LoadItem(
                        lease_id=it.lease_id,
                        lease_offset=it.lease_offset,
                        block_ids=np.asarray(it.block_ids, np.uint32).tolist(),
                    )
                    for it in items
                ],
                layer_seq=layer_seq,
                owner_token=self._token(instance_id, tp_rank),
                deadline_ns=deadlines.to_wire(self.timeout_s),
            ),
            self._copy_wait_s(),
        )
        results = tuple(LoadItemResult(r.loaded, r.bytes, r.error) for r in resp.items)
        if len(results) != len(items):  # a server without batched loads
            raise PegaflowError(
                f"Load: {len(results)} item results for {len(items)} items"
            )
        return LoadBatchResult(resp.loaded, resp.bytes, results)

    def _fast_load(
        self,
        instance_id: str,
        tp_rank: int,
        specs: list,
        batch: bool,
        layer_seq: int,
    ) -> LoadBatchResult | None:
        """Over the server's socket; None when gRPC must carry it. After a broken
        connection gRPC repeats the load: its lease may be consumed by then, and
        the error says so (vLLM recomputes those blocks)."""
        fast = self._fast_client()
        if fast is None:
            return None
        token = self._token(instance_id, tp_rank)
        deadline_ns = deadlines.to_wire(self.timeout_s)
        frame = encode_load(
            instance_id, tp_rank, specs, batch, layer_seq, deadline_ns, token
        )
        res = None
        if frame is not None:
            res = self._fast_call(fast.load, frame, self._copy_wait_s())
        if res is None:
            return None
        loaded, nbytes, items = res
        if len(items) != len(specs):
            raise PegaflowError(f"Load: {len(items)} item results for {len(specs)}")
        return LoadBatchResult(
            loaded, nbytes, tuple(LoadItemResult(*item) for item in items)
        )

    def use_query_socket(self, path: str) -> None:
        """Send prefix queries over the server's unix socket from now on (gRPC
        stays the fallback). For clients that never register, e.g. vLLM's
        scheduler: its workers learn of the socket at registration and pass
        the path on; the server's own ServerInfo answer says which to use."""
        if path and not self._socket_off and self._fast is None:
            self._fast_path = path
            self._server = None  # ask the server on first use

    def disable_socket(self) -> None:
        """gRPC for every call from now on (registration of host memory
        included, which the server refuses over TCP by default)."""
        self._socket_off = True
        self._drop_fast_path()
        self._fast_path = ""

    def _fast_client(self) -> FastPathClient | None:
        if self._fast is not None or not self._fast_path:
            return self._fast
        if time.monotonic() < self._socket_retry_at:
            return None
        try:
            info = self._server if self._server is not None else self._server_info()
            if not info.socket_path:
                return None
            self._fast = FastPathClient(
                info.socket_path, self.timeout_s, info.server_id, info.server_pid
            )
        except (OSError, PegaflowError) as exc:  # another host, user, or gone
            logger.debug("server socket %s unusable: %s", self._fast_path, exc)
            # Ask the server again later: it may have restarted meanwhile.
            self._server = None
            self._socket_retry_at = time.monotonic() + SOCKET_RETRY_S
        return self._fast

    def _fast_call(
        self, call: Callable[[bytes, float], object], frame: bytes, wait_s: float
    ) -> object | None:
        """The reply, or None when the socket broke (the caller uses gRPC)."""
        try:
            return call(frame, wait_s)
        except TimeoutError:  # no answer even after the grace: as gRPC reports it
            self._drop_fast_path()
            raise from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no reply in {wait_s:g} s"
            ) from None
        except OSError as exc:  # server gone or restarted: gRPC decides
            logger.debug("fast-path socket failed (%s); using gRPC", exc)
            self._drop_fast_path()
            return None

    def _drop_fast_path(self) -> None:
        if self._fast is not None:
            self._fast.close()
            self._fast = None

    def release_lease(self, lease_id: int) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id))

    def unregister(self, instance_id: str, tp_rank: int = 0) -> None:
        token = self._token(instance_id, tp_rank)
        self._call(
            "Unregister",
            pb.UnregisterRequest(
                instance_id=instance_id, tp_rank=tp_rank, owner_token=token
            ),
        )
        self._tokens.pop((instance_id, tp_rank), None)

    def health(self, timeout_s: float | None = None) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(
                health_pb2.HealthCheckRequest(service=""),
                timeout=timeout_s or self.timeout_s,
            )
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def open_session(
        self, instance_id: str, tp_rank: int = 0, interval_s: float = 5.0
    ) -> Session:
        token = self._token(instance_id, tp_rank)
        return Session(self._stub, instance_id, tp_rank, interval_s, token)

    def close(self) -> None:
        self._drop_fast_path()
        self._channel.close()

    def __enter__(self) -> PegaflowClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        self._pings.put(None)
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            self._stream.cancel()


def _layer_message(layer: LayerLayout) -> pb.LayerLayout:
    return pb.LayerLayout(
        region_index=layer.region_index,
        offset=layer.offset,
        num_blocks=layer.num_blocks,
        block_stride=layer.block_stride,
        segments=[pb.Segment(offset=s.offset, size=s.size) for s in layer.segments],
    )


def _signals_message(address: int) -> pb.LayerSignals | None:
    if not address:
        return None
    return pb.LayerSignals(pid=os.getpid(), address=address)
