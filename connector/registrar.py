"""The worker's registration with the server, kept alive across server restarts.

The KV memory is described once; registering (and re-registering after the
server restarted or our session dropped) only sends that description again.
Host KV registers (pid, address, size) for process_vm_readv/writev, and (unless
share_host_kv is off) is first backed with a sealed memfd that every
registration then hands the server to map, so its copies are memcpy
(pegaflow.client.host_share); CUDA KV is the one other branch: IPC handles +
interprocess events through `PegaflowClient.register_cuda`. MLA KV registers as
replicated: the server keeps one shard per block, which any rank saves and
every rank loads.

A hybrid model registers once per KV cache group (its own instance id and
namespace: the group's pages have their own geometry).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from pegaflow.client.host_share import SharedMemory, share_memory
from pegaflow.client.kv_layouts import describe
from pegaflow.client.pegaflow_client import PegaflowClient, Session
from pegaflow.common.errors import NotSupported, PegaflowError

from .extra_config import ConnectorConfig
from .kv_groups import GroupRule
from .tensors import KVTensors, kv_tensors, namespace_digest, namespace_parts

logger = logging.getLogger(__name__)

Regions = tuple[tuple[int, int], ...]


def signal_words(layers: int, own_pages: bool) -> np.ndarray:
    """The words the server writes as each layer of a sync load lands. On
    pages of their own where back_with_memfd will share them with the server
    (a host engine's only registration): nothing else of this process is
    shared with them."""
    if not own_pages or not layers:
        return np.zeros(layers, np.uint64)
    pages = mmap.mmap(-1, -(-8 * layers // mmap.PAGESIZE) * mmap.PAGESIZE)
    return np.frombuffer(pages, np.uint64, count=layers)  # keeps `pages`


class Registrar:
    def __init__(
        self,
        client: PegaflowClient,
        config: ConnectorConfig,
        instance_id: str,
        tp_rank: int,
        tp_size: int,
        pool: ThreadPoolExecutor,
        group: GroupRule | None = None,
    ) -> None:
        self.client = client
        self.config = config
        self.instance_id = instance_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.group = group  # None: the model's only group
        self.namespace = ""
        self.replicated = False  # every rank holds the same KV (MLA)
        self.registered = False
        self.slot_bytes = 0
        self.new_socket_path = ""
        # Per-layer load progress the server writes (layer-wise sync loads).
        self.layer_signals = np.zeros(0, np.uint64)
        self.layer_index: dict[str, int] = {}
        self._pool = pool
        self._register_fn: Any = None  # () -> Registration, set by describe()
        self._events: Any = None  # pegaflow.client.cuda_export.IpcEvents for CUDA KV
        self._device = "cpu"
        self._host_regions: tuple[tuple[int, int], ...] = ()
        self._shared: SharedMemory | None = None  # host KV's memfd, if any
        self._session: Session | None = None
        # An attempt on the I/O pool and close() on the engine's thread: the
        # session an attempt opens is either kept (close ends it) or, once
        # closed, ended by the attempt itself, never left open.
        self._session_lock = threading.Lock()
        self._attempt: Future | None = None
        self._next_try = 0.0

    def describe(
        self,
        kv_caches: dict[str, Any],
        num_blocks: int,
        vllm_config: Any,
        shared_signals: bool = True,
    ) -> KVTensors:
        """shared_signals: back_with_memfd will put the layer signal words in
        the KV's memfd (host KV only)."""
        kv = kv_tensors(kv_caches, num_blocks)
        # kv.tensors keep kv_caches' order: layer i is the i-th name.
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        own_pages = shared_signals and kv.device == "cpu"
        self.layer_signals = signal_words(len(kv.tensors), own_pages)
        signals = self.layer_signals.ctypes.data
        parts = namespace_parts(vllm_config, kv, self.config.namespace_salt)
        if self.group is not None:
            # Which layers (this stage's, of this group), and how the group
            # restores them: two engines share a part's blocks only if both
            # are the same.
            g = self.group
            parts["kv_group"] = {
                "index": g.index,
                "kind": g.kind,
                "block_size": g.block_size,
                "span": g.span,
                "layers": list(kv_caches),
            }
        self.namespace = namespace_digest(parts, self.config.tenant_secret)
        self.replicated = bool(parts["mla"])
        self._device = kv.device
        if kv.device == "cpu":
            mem = describe(kv.tensors, kv_first=kv.kv_first)
            self._host_regions = mem.regions
            self._register_fn = lambda: self.client.register_host(
                self.instance_id,
                self.namespace,
                os.getpid(),
                mem.regions,
                mem.layers,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                replicated=self.replicated,
                layer_signals=signals,
            )
        else:
            self._register_fn = self._describe_cuda(kv, signals)
        logger.info(  # the parts, never the secret: only whether there is one
            "pegaflow: %d layers of %s KV, namespace %s (%s, tenant secret: %s)",
            len(kv.tensors),
            kv.device,
            self.namespace,
            parts,
            "yes" if self.config.tenant_secret else "no",
        )
        return kv

    def back_with_memfd(
        self, shares: dict[Regions, SharedMemory | None], with_signals: bool = True
    ) -> None:
        """Host KV: back it with a sealed memfd for the server to map (once
        per set of regions: a hybrid model's groups overlay one buffer).
        Only from register_kv_caches, before the engine writes KV: a write
        while a chunk is copied and remapped would be lost. with_signals:
        the layer signal words' own pages go in the memfd too, so the server
        stores each layer's word without a system call; only where no other
        registration of this process backs the same KV (one group, one
        stage), as a second memfd mapped over shared pages would cut the
        first one's server mapping off from them."""
        if not self._host_regions or not self.config.share_host_kv:
            return
        key = self._host_regions
        if with_signals and self.layer_signals.size:
            words = self.layer_signals.ctypes.data, self.layer_signals.nbytes
            if words[0] % mmap.PAGESIZE == 0:  # their own pages (signal_words)
                pages = -(-words[1] // mmap.PAGESIZE) * mmap.PAGESIZE
                key += ((words[0], pages),)
        if key not in shares:
            shares[key] = share_memory(key)
        self._shared = shares[key]

    def _describe_cuda(self, kv: KVTensors, signals: int) -> Any:
        try:
            from pegaflow.client.cuda_export import IpcEvents, export_kv
        except ImportError as exc:  # cuda-python missing: the [cuda] extra
            raise NotSupported(
                f"PegaKVConnector: CUDA KV cannot register ({exc}); install "
                "pegaflow-py[cuda] into vLLM's environment"
            ) from None
        cuda_kv = export_kv(kv.tensors, kv_first=kv.kv_first)
        self._events = IpcEvents(int(kv.device.split(":")[1]))
        register_cuda = self.client.register_cuda
        return lambda: register_cuda(
            self.instance_id,
            self.namespace,
            cuda_kv,
            self._events.handles,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            replicated=self.replicated,
            layer_signals=signals,
        )

    def register_now(self) -> bool:
        """Register and open the liveness session; False (and retry later) if
        the server cannot be reached or refuses."""
        register = self._register_fn
        if register is None:  # closed meanwhile (an attempt on the pool thread)
            return False
        if self._session is not None:
            self._session.close()
            self._session = None
        try:
            reg = register()
            session = self.client.open_session(self.instance_id, self.tp_rank)
        except PegaflowError as exc:
            self._next_try = time.monotonic() + self.config.retry_interval_s
            logger.warning(
                "pegaflow: cannot register %s rank %d at %s (%s); running without "
                "the cache, retrying every %.1f s",
                self.instance_id,
                self.tp_rank,
                self.config.addr,
                exc,
                self.config.retry_interval_s,
            )
            return False
        with self._session_lock:
            closed = self._register_fn is None
            if not closed:
                self._session = session
                self.slot_bytes = reg.slot_bytes
                self.new_socket_path = reg.socket_path  # for the scheduler, once
                self.registered = True
        if closed:  # while it ran: the server drops what it registered
            session.close()
            return False
        logger.info("pegaflow: registered %s rank %d", self.instance_id, self.tp_rank)
        self._share()
        return True

    def _share(self) -> None:
        """Hand this registration the memfd; without it (an older server, no
        socket, a refusal) copies stay on process_vm, as they were."""
        shared = self._shared
        if shared is None:
            return
        try:
            got = self.client.share_host(
                self.instance_id, self.tp_rank, shared.fd, shared.spans
            )
        except (PegaflowError, OSError) as exc:
            logger.warning(
                "pegaflow: the server did not map our KV memory (%s); its copies "
                "use process_vm",
                exc,
            )
            return
        if got is None:
            logger.info("pegaflow: no server socket: KV copies use process_vm")
        else:
            logger.info("pegaflow: the server maps %d B of our KV memory", got)

    def tick(self) -> None:
        """Once per step, on the engine's thread: notice a dropped session and
        retry registration in the background."""
        if self.registered:
            if self._session is not None and not self._session.alive:
                self.lost("session closed")
            return
        if self._attempt is not None:
            if self._attempt.done():
                self._attempt = None
            return
        if self._register_fn is not None and time.monotonic() >= self._next_try:
            self._attempt = self._pool.submit(self.register_now)

    def wait_registered(self) -> bool:
        """Registered, or, while an attempt is under way, once it ends
        (bounded by the client's deadline): the server counts a registration
        from its RegisterKV on, and the scheduler may lease this part's
        blocks before the attempt has opened its session. A Load then waits
        for it instead of throwing away hits that were granted; not for one
        still queued: it shares the I/O pool, so it may be waiting for this
        very thread."""
        attempt = self._attempt  # set and cleared on the engine's thread
        if not self.registered and attempt is not None and attempt.running():
            wait([attempt], timeout=self.config.timeout_s)
        return self.registered

    def lost(self, reason: str) -> None:
        if self.registered:
            logger.warning("pegaflow: registration lost (%s); re-registering", reason)
        self.registered = False

    @property
    def device(self) -> str:
        """Where the KV lives ("cpu", "cuda:N"), once registered."""
        return self._device

    def record_compute_done(self) -> int:
        """CUDA KV: an event after this step's KV writes, for the server's copy
        to wait on (no host sync here). Host KV: 0, the forward is done."""
        if self._events is None:
            return 0
        import torch

        stream = torch.cuda.current_stream(torch.device(self._device))
        return self._events.record(stream.cuda_stream)

    def load_event(self) -> int:
        """CUDA KV: one of our events for the server to record after a load's
        copy (PegaflowClient.load's done_event); host KV: 0, loads answer done."""
        return 0 if self._events is None else self._events.load_event()

    def wait_loaded(
        self, event: int, timeout_s: float, nbytes: int, sent: float, fd: int
    ) -> None:
        """Until a load answered in flight landed (its event completed); CopyFailed
        if it failed, if its connection `fd` ended first, or if it did not land
        within timeout_s."""
        self._events.wait(event, timeout_s, nbytes, sent, fd)

    def close(self) -> None:
        with self._session_lock:
            self._register_fn = None  # a closure over self: a cycle until collected
            session, self._session = self._session, None
            self.registered = False
        if session is not None:
            session.close()
        self._shared = None  # the worker closes it (one may serve several)
        if self._events is not None:
            self._events.close()
            self._events = None
