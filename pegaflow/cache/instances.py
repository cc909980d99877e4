"""Registered engine workers and the namespaces they belong to.

A namespace fixes the byte geometry of its blocks (shards per block and per-layer
segment sizes); every worker that joins it later must agree, so blocks saved by one
engine are byte-compatible with every other engine that loads them.

A block has one shard per TP rank (each rank's KV heads), or a single shard when
the KV is replicated on every rank (MLA's latent cache): then whichever rank saves
a block stores the whole of it, once, and every rank loads that copy.
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from pegaflow.common.errors import (
    InstanceHeld,
    InvalidRequest,
    NotSupported,
    PermissionDenied,
    UnknownInstance,
)
from pegaflow.common.geometry import KVGeometry
from pegaflow.common.identity import UNKNOWN, Caller, check_host_memory_owner
from pegaflow.common.keys import TOKEN_BYTES, Namespace
from pegaflow.common.pidfds import PidsHeld
from pegaflow.copiers.copier import CopyEngine, LoadSignals, OpenSignals, RegionKind

from .registration_checks import RegisterSpec, validate_spec

logger = logging.getLogger(__name__)


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
    signals: LoadSignals | None = None  # per-layer load progress, if registered
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
        open_signals: OpenSignals | None = None,
    ) -> None:
        self._copiers = copiers
        self._open_signals = open_signals
        self._allow_tcp = allow_tcp_host_engines
        self._max_slot_bytes = max_slot_bytes  # a block of one rank must fit a slot
        self.namespaces: dict[str, Namespace] = {}
        self.instances: dict[str, Instance] = {}
        # A new namespace -> the recovered one of its name and geometry, if any
        # (pegaflow.server.warm_restart: a restarted server's kept pool).
        self.adopt: Callable[[Namespace], Namespace] | None = None

    def register(self, spec: RegisterSpec, caller: Caller) -> Worker:
        validate_spec(spec)
        with PidsHeld(_named_pids(spec)) as held:
            return self._register(spec, caller, held)

    def _register(self, spec: RegisterSpec, caller: Caller, held: PidsHeld) -> Worker:
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
                if self._open_signals is None:
                    raise NotSupported("layer_signals: this server has no signals")
                signals = self._open_signals(*spec.layer_signals, geometry.num_layers)
            held.check()  # the owner checked above is the process opened here
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

    def is_current(self, worker: Worker) -> bool:
        """Whether worker is still the registration of its instance and rank
        (not unregistered, nor replaced by a newer registration)."""
        inst = self.instances.get(worker.instance_id)
        return inst is not None and inst.workers.get(worker.tp_rank) is worker

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


def _named_pids(spec: RegisterSpec) -> list[tuple[int, str]]:
    """The processes whose memory a registration would open: the host
    regions' and the layer signals' (a CUDA export names no process to copy
    through)."""
    pids = [(spec.pid, "regions.host.pid")] if spec.region_kind == "host" else []
    if spec.layer_signals is not None:
        pids.append((spec.layer_signals[0], "layer_signals.pid"))
    return pids
