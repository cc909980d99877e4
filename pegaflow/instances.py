"""Registered engine workers and the namespaces they belong to.

A namespace fixes the byte geometry of its blocks (shards per block and per-layer
segment sizes); every worker that joins it later must agree, so blocks saved by one
engine are byte-compatible with every other engine that loads them.

A block has one shard per TP rank (each rank's KV heads), or a single shard when
the KV is replicated on every rank (MLA's latent cache): then whichever rank saves
a block stores the whole of it, once, and every rank loads that copy.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pegaflow.errors import (
    InstanceHeld,
    InvalidRequest,
    NotSupported,
    PermissionDenied,
    UnknownInstance,
)
from pegaflow.hostcopy import LayerSignals
from pegaflow.identity import UNKNOWN, Caller, check_host_memory_owner
from pegaflow.layout import KVGeometry, LayerLayout, validate_layers

logger = logging.getLogger(__name__)

RegionKind = Literal["host", "cuda"]
MAX_ID_LEN = 256
MAX_TP = 1024
MAX_REGIONS = 64
MAX_EVENTS = 64
IPC_HANDLE_BYTES = 64
UUID_BYTES = 16
TOKEN_BYTES = 16
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d{1,3})$")


@dataclass(frozen=True, slots=True)
class CudaExport:
    """What a GPU worker sends beside its (offset, size) regions."""

    ipc_handles: tuple[bytes, ...]  # one per region: its allocation's handle
    device_uuid: bytes
    event_handles: tuple[bytes, ...] = ()  # SaveRequest.wait_event picks one


class CopyEngine(Protocol):
    """Moves descriptor tables between one worker's KV memory and pool slots."""

    def open(
        self,
        pid: int,
        regions: list[tuple[int, int]],
        cuda: CudaExport | None = None,
    ) -> object: ...
    def gather(
        self,
        handle: object,
        transfers: object,
        wait_event: int = 0,
        deadline: float | None = None,
    ) -> None: ...
    def scatter(
        self, handle: object, transfers: object, deadline: float | None = None
    ) -> None: ...
    def close(self, handle: object) -> None: ...


@dataclass(frozen=True, slots=True)
class RegisterSpec:
    instance_id: str
    namespace: str
    tp_rank: int
    tp_size: int
    world_size: int
    device: str
    region_kind: RegionKind
    pid: int
    regions: tuple[tuple[int, int], ...]  # (address or offset, size)
    layers: tuple[LayerLayout, ...]
    cuda: CudaExport | None = None  # set exactly when region_kind == "cuda"
    replicated: bool = False  # every rank holds the same KV (MLA): one shard
    layer_signals: tuple[int, int] | None = None  # (pid, address): see hostcopy
    owner_token: bytes = b""  # of the caller's previous registration, if any

    @property
    def shards(self) -> int:
        return 1 if self.replicated else self.tp_size


def namespace_tag(name: str) -> str:
    """A one-way label of a namespace for /metrics, /stats and logs: equal
    names give equal tags, and a tag does not give the name back (a namespace
    made with a tenant secret cannot be read off the server's outputs)."""
    return hashlib.sha256(b"pegaflow-ns-tag" + name.encode()).hexdigest()[:12]


@dataclass(slots=True)
class Namespace:
    name: str  # never shown: clients see the tag (see namespace_tag)
    id: int
    tp_size: int  # shards per block: the TP size, or 1 for replicated KV (MLA)
    num_layers: int
    slot_bytes: int
    signature: tuple[int, ...]
    slot_skew: int = 0  # engine pages' offset modulo 4 KiB (see pool.SlabAllocator)

    @property
    def slot_class(self) -> tuple[int, int]:
        return (self.slot_bytes, self.slot_skew)

    @property
    def tag(self) -> str:
        return namespace_tag(self.name)


@dataclass(slots=True)
class Worker:
    instance_id: str
    tp_rank: int
    namespace: Namespace
    world_size: int
    geometry: KVGeometry
    copier: CopyEngine
    handle: object
    shard: int = 0  # which of a block's shards it saves and loads
    signals: LayerSignals | None = None  # per-layer load progress, if registered
    active_ops: int = 0
    closed: bool = False
    owner: Caller = Caller("tcp")  # who registered it, as the kernel said
    owner_token: bytes = b""  # the capability its later requests carry

    def check_owner(self, caller: Caller, token: bytes) -> None:
        """Only the registering process acts for a worker: it alone learnt the
        token, and on the socket the kernel's pid must match too."""
        if not hmac.compare_digest(token, self.owner_token):
            raise PermissionDenied(
                f"owner_token: does not match the registration of "
                f"{self.instance_id!r} rank {self.tp_rank}; only the process "
                "that registered it may save, load or unregister for it"
            )
        if (
            caller.transport == "unix"
            and self.owner.pid != UNKNOWN
            and caller.pid != self.owner.pid
        ):
            raise PermissionDenied(
                f"instance_id: {self.instance_id!r} rank {self.tp_rank} belongs to "
                f"pid {self.owner.pid}, not to the caller (pid {caller.pid})"
            )


@dataclass(slots=True)
class Instance:
    id: str
    namespace: Namespace
    tp_size: int
    world_size: int
    workers: dict[int, Worker] = field(default_factory=dict)
    owner_uid: int = UNKNOWN  # every rank of an instance runs as one user


def _check_ident(value: str, field_name: str) -> None:
    if not value or len(value) > MAX_ID_LEN or not value.isprintable():
        raise InvalidRequest(
            f"{field_name}: must be 1..{MAX_ID_LEN} printable characters"
        )


def validate_spec(spec: RegisterSpec) -> None:
    _check_ident(spec.instance_id, "instance_id")
    _check_ident(spec.namespace, "namespace")
    if not 1 <= spec.tp_size <= MAX_TP:
        raise InvalidRequest(f"tp_size: {spec.tp_size} not in 1..{MAX_TP}")
    if not 0 <= spec.tp_rank < spec.tp_size:
        raise InvalidRequest(f"tp_rank: {spec.tp_rank} not in 0..{spec.tp_size - 1}")
    if not spec.tp_size <= spec.world_size <= MAX_TP * 64:
        raise InvalidRequest(
            f"world_size: {spec.world_size} must be >= tp_size ({spec.tp_size})"
        )
    if not _DEVICE_RE.match(spec.device):
        raise InvalidRequest(f"device: {spec.device!r} is not 'cpu' or 'cuda:N'")
    if not 1 <= len(spec.regions) <= MAX_REGIONS:
        raise InvalidRequest(f"regions: need 1..{MAX_REGIONS}, got {len(spec.regions)}")
    if (spec.region_kind == "host") != (spec.device == "cpu"):
        raise InvalidRequest(
            f"regions: {spec.region_kind} regions do not match device {spec.device}"
        )
    for i, (_, size) in enumerate(spec.regions):
        if size <= 0:
            raise InvalidRequest(f"regions[{i}].size: must be > 0")
    if (spec.cuda is None) != (spec.region_kind == "host"):
        raise InvalidRequest("regions: cuda regions need their ipc handles")
    if spec.cuda is not None:
        _check_cuda(spec.cuda, len(spec.regions))
    if spec.owner_token and len(spec.owner_token) != TOKEN_BYTES:
        raise InvalidRequest(
            f"owner_token: {len(spec.owner_token)} bytes, need {TOKEN_BYTES} or none"
        )
    validate_layers(spec.layers, [size for _, size in spec.regions])


def _check_cuda(cuda: CudaExport, regions: int) -> None:
    if len(cuda.ipc_handles) != regions:
        raise InvalidRequest("regions: every cuda region needs its ipc_handle")
    for i, h in enumerate(cuda.ipc_handles):
        if len(h) != IPC_HANDLE_BYTES:
            raise InvalidRequest(
                f"regions[{i}].cuda.ipc_handle: {len(h)} bytes, need {IPC_HANDLE_BYTES}"
            )
    if len(cuda.device_uuid) != UUID_BYTES:
        raise InvalidRequest(
            f"regions.cuda.device_uuid: {len(cuda.device_uuid)} bytes, need "
            f"{UUID_BYTES} (one device per worker)"
        )
    if len(cuda.event_handles) > MAX_EVENTS:
        raise InvalidRequest(f"event_handles: more than {MAX_EVENTS}")
    if any(len(h) != IPC_HANDLE_BYTES for h in cuda.event_handles):
        raise InvalidRequest(f"event_handles: each needs {IPC_HANDLE_BYTES} bytes")


class Registry:
    """Namespaces, instances and their workers; all calls from one thread."""

    # The last namespace id handed out. Ids are never reused, not even after a
    # namespace is released: block keys, leases and hit-rate state carry the id,
    # and a reused one would alias a freed namespace's keys with a new one's.
    _last_namespace_id = 0

    def __init__(
        self,
        copiers: dict[RegionKind, CopyEngine],
        max_slot_bytes: int = 1 << 62,
        allow_tcp_host_engines: bool = False,
    ) -> None:
        self._copiers = copiers
        self._allow_tcp = allow_tcp_host_engines
        self._max_slot_bytes = max_slot_bytes  # a block of one rank must fit a slot
        self.namespaces: dict[str, Namespace] = {}
        self.instances: dict[str, Instance] = {}
        # A new namespace -> the recovered one of its name and geometry, if any
        # (pegaflow.recovery: a restarted server's kept pool).
        self.adopt: Callable[[Namespace], Namespace] | None = None

    def register(self, spec: RegisterSpec, caller: Caller) -> Worker:
        validate_spec(spec)
        self._check_caller(spec, caller)
        copier = self._copiers.get(spec.region_kind)
        if copier is None:
            raise NotSupported(
                f"regions: this server has no {spec.region_kind} copy engine "
                "(started without a GPU stack?)"
            )
        handle = copier.open(spec.pid, list(spec.regions), spec.cuda)
        new_namespace = spec.namespace not in self.namespaces
        signals = None
        try:
            bases = [_base(handle, i, spec.regions) for i in range(len(spec.regions))]
            geometry = KVGeometry(spec.layers, bases)
            if geometry.slot_bytes + geometry.page_skew > self._max_slot_bytes:
                raise InvalidRequest(
                    f"layers: a block is {geometry.slot_bytes} bytes per rank; the "
                    f"pool's slots hold at most {self._max_slot_bytes}"
                )
            if spec.layer_signals is not None:
                signals = LayerSignals(*spec.layer_signals, geometry.num_layers)
            ns = self._namespace_for(spec, geometry)
            instance = self._instance_for(spec, ns)
        except BaseException:
            if signals is not None:
                signals.close()
            copier.close(handle)
            if new_namespace:  # a rejected request must not fix a geometry
                self.namespaces.pop(spec.namespace, None)
            raise
        if new_namespace and self.adopt is not None:
            ns = instance.namespace = self.adopt(ns)
        old = instance.workers.get(spec.tp_rank)
        if old is not None:
            self._retire(old)
        if instance.owner_uid == UNKNOWN:
            instance.owner_uid = caller.uid
        worker = Worker(
            spec.instance_id,
            spec.tp_rank,
            ns,
            spec.world_size,
            geometry,
            copier,
            handle,
            0 if spec.replicated else spec.tp_rank,
            signals,
            owner=caller,
            owner_token=secrets.token_bytes(TOKEN_BYTES),
        )
        instance.workers[spec.tp_rank] = worker
        logger.info(
            "registered %s rank %d/%d in namespace %s (%d layers, %d B/block%s)",
            spec.instance_id,
            spec.tp_rank,
            spec.tp_size,
            ns.tag,
            geometry.num_layers,
            geometry.slot_bytes,
            ", replicated" if spec.replicated else "",
        )
        return worker

    def _check_caller(self, spec: RegisterSpec, caller: Caller) -> None:
        """Before anything is opened: may this caller register this memory, and
        this instance id and rank?"""
        if spec.region_kind == "host":
            check_host_memory_owner(
                spec.pid, caller, "regions.host.pid", self._allow_tcp
            )
        if spec.layer_signals is not None:
            check_host_memory_owner(
                spec.layer_signals[0], caller, "layer_signals.pid", self._allow_tcp
            )
        inst = self.instances.get(spec.instance_id)
        if inst is None or not inst.workers:
            return
        old = inst.workers.get(spec.tp_rank)
        if old is not None:
            same_process = caller.transport == "unix" and caller.pid == old.owner.pid
            same_token = bool(spec.owner_token) and hmac.compare_digest(
                spec.owner_token, old.owner_token
            )
            if not (same_process or same_token):
                raise InstanceHeld(
                    f"instance_id: {spec.instance_id!r} rank {spec.tp_rank} is "
                    f"registered by {old.owner.label}; give every engine its own "
                    "instance id, or let that process unregister first"
                )
        known = UNKNOWN not in (inst.owner_uid, caller.uid)
        if known and inst.owner_uid != caller.uid:
            raise PermissionDenied(
                f"instance_id: {spec.instance_id!r} belongs to uid "
                f"{inst.owner_uid}, the caller is uid {caller.uid}"
            )

    def _namespace_for(self, spec: RegisterSpec, geometry: KVGeometry) -> Namespace:
        ns = self.namespaces.get(spec.namespace)
        if ns is None:
            self._last_namespace_id += 1
            ns = Namespace(
                spec.namespace,
                self._last_namespace_id,
                spec.shards,
                geometry.num_layers,
                geometry.slot_bytes,
                geometry.signature(),
                geometry.page_skew,
            )
            self.namespaces[spec.namespace] = ns
            return ns
        # Neither the name nor the other engine's geometry goes back: only
        # what this request itself said.
        if ns.tp_size != spec.shards:
            what = f"tp_size: {spec.tp_size} shard(s)"
            if spec.replicated:
                what = "replicated: 1 shard"
            raise InvalidRequest(
                f"{what} per block differs from this namespace's (registered by "
                "another engine)"
            )
        if ns.signature != geometry.signature():
            raise InvalidRequest(
                "layers: page geometry differs from this namespace's (registered "
                f"by another engine); this request has {geometry.num_layers} "
                f"layers, {geometry.slot_bytes} B/block"
            )
        return ns

    def release_namespace(self, ns: Namespace) -> bool:
        """Forget ns if no registered worker uses it; False if one does (or ns
        is no longer the namespace of its name). The caller checks that no
        block or lease of it is left: those are the engine's."""
        if self.namespaces.get(ns.name) is not ns:
            return False
        if any(i.workers and i.namespace is ns for i in self.instances.values()):
            return False
        del self.namespaces[ns.name]
        return True

    def _instance_for(self, spec: RegisterSpec, ns: Namespace) -> Instance:
        inst = self.instances.get(spec.instance_id)
        if inst is None:
            inst = Instance(spec.instance_id, ns, spec.tp_size, spec.world_size)
            self.instances[spec.instance_id] = inst
        elif (inst.namespace, inst.tp_size, inst.world_size) != (
            ns,
            spec.tp_size,
            spec.world_size,
        ) and inst.workers:
            raise InvalidRequest(
                f"instance_id: {spec.instance_id!r} is registered with another "
                "namespace, tp_size or world_size"
            )
        else:
            inst.namespace, inst.tp_size, inst.world_size = (
                ns,
                spec.tp_size,
                spec.world_size,
            )
        return inst

    def instance(self, instance_id: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or not inst.workers:
            raise UnknownInstance(f"instance_id: {instance_id!r} is not registered")
        return inst

    def worker(self, instance_id: str, tp_rank: int) -> Worker:
        worker = self.instance(instance_id).workers.get(tp_rank)
        if worker is None:
            raise UnknownInstance(
                f"tp_rank: rank {tp_rank} of {instance_id!r} is not registered"
            )
        return worker

    def owned_worker(
        self, instance_id: str, tp_rank: int, caller: Caller, token: bytes
    ) -> Worker:
        """The worker, if the caller is its owner (see Worker.check_owner)."""
        worker = self.worker(instance_id, tp_rank)
        worker.check_owner(caller, token)
        return worker

    def unregister(self, instance_id: str, tp_rank: int) -> Worker:
        worker = self.worker(instance_id, tp_rank)
        inst = self.instances[instance_id]
        del inst.workers[tp_rank]
        if not inst.workers:
            del self.instances[instance_id]
        self._retire(worker)
        logger.info("unregistered %s rank %d", instance_id, tp_rank)
        return worker

    def _retire(self, worker: Worker) -> None:
        worker.closed = True
        if worker.active_ops == 0:
            _close(worker)

    def finish_op(self, worker: Worker) -> None:
        """Called when a copy on the worker's memory ends; closes it if retired."""
        worker.active_ops -= 1
        if worker.closed and worker.active_ops == 0:
            _close(worker)

    def close(self) -> None:
        for inst in list(self.instances.values()):
            for worker in list(inst.workers.values()):
                self._retire(worker)
        self.instances.clear()


def _close(worker: Worker) -> None:
    """After the worker's last copy: its pidfd guards those until the end."""
    if worker.signals is not None:
        worker.signals.close()
    worker.copier.close(worker.handle)


def _base(handle: object, index: int, regions: tuple[tuple[int, int], ...]) -> int:
    bases = getattr(handle, "bases", None)
    return int(bases[index]) if bases is not None else regions[index][0]
