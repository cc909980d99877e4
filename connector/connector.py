"""PegaKVConnector: vLLM's KVConnectorBase_V1 as a thin facade over the
scheduler half (scheduler.py) and the worker half (worker.py). It supports
vLLM's hybrid KV cache manager (SupportsHMA): each KV cache group is restored
by its own rule (kv_groups.py).

    --kv-transfer-config '{"kv_connector":"PegaKVConnector","kv_role":"kv_both",
                           "kv_connector_module_path":"pegaflow.connector"}'
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from .extra_config import failure_policy_warning, parse_config, resolved_poll
from .kv_events import KVEventsFeed, watched_parts
from .kv_groups import KVGroups, groups_of
from .scheduler import SchedulerHalf
from .stats import PegaConnectorStats, PegaPromMetrics
from .step_plan import StepPlan, WorkerReport, new_stats
from .vllm_compat import check_sleep_mode
from .worker import WorkerHalf

logger = logging.getLogger(__name__)


class PegaConnectorMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class PegaWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PegaWorkerMetadata)
        return PegaWorkerMetadata(self.report.merge(other.report))


def instance_id(vllm_config: Any, configured: str = "") -> str:
    """Same in the scheduler and its workers (vllm_config travels to both).
    `configured` (the instance_id option) replaces the engine id part; each
    data-parallel replica still gets its own suffix, as the replicas share
    one kv_transfer_config and are separate engines to the server."""
    par = vllm_config.parallel_config
    ident = configured or f"vllm-{vllm_config.kv_transfer_config.engine_id}"
    if par.data_parallel_size > 1:
        ident += f"-dp{par.data_parallel_rank}"
    return ident


def _tp_rank(vllm_config: Any) -> int:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_tensor_model_parallel_rank()
    par = vllm_config.parallel_config
    return par.rank % par.tensor_parallel_size


def _pp_rank(vllm_config: Any) -> int:
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_pp_group().rank_in_group
    par = vllm_config.parallel_config
    return par.rank // par.tensor_parallel_size % par.pipeline_parallel_size


def _check_supported(vllm_config: Any, kv_cache_config: Any) -> KVGroups:
    par = vllm_config.parallel_config
    # Context parallelism splits a block's tokens across ranks: neither one
    # shard per rank of whole blocks nor (MLA) the same KV on every rank.
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(par, name, 1) > 1:
            raise ValueError(f"PegaKVConnector: {name} > 1 is not supported")
    check_sleep_mode(vllm_config)
    return groups_of(kv_cache_config, vllm_config.cache_config.block_size)


def _zeroes_before_preemptions(vllm_config: Any, kv_cache_config: Any) -> bool:
    """vLLM 0.33's V2 model runner zeroes the blocks a step allocates (KV with
    Mamba state or of mixed precision) before it calls handle_preemptions,
    so a block freed by a preemption may be rewritten before we could wait
    for its Save there."""
    zeroing = getattr(kv_cache_config, "needs_kv_cache_zeroing", False)
    return bool(zeroing and getattr(vllm_config, "use_v2_model_runner", False))


class PegaKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = resolved_poll(
            parse_config(self._kv_transfer_config.kv_connector_extra_config),
            getattr(getattr(vllm_config, "device_config", None), "device_type", None),
        )
        groups = self._groups = _check_supported(vllm_config, kv_cache_config)
        ident = instance_id(vllm_config, self.config.instance_id)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        stages = vllm_config.parallel_config.pipeline_parallel_size
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._events: KVEventsFeed | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", None)
            if warning := failure_policy_warning(policy):
                logger.warning("%s", warning)
            algo = vllm_config.cache_config.prefix_caching_hash_algo
            if algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
                logger.warning(
                    "pegaflow: %s block hashes are random per process unless "
                    "PYTHONHASHSEED is set: other engines will never hit them",
                    algo,
                )
            block_size = vllm_config.cache_config.block_size
            # Every worker of every stage reports each save job.
            workers = tp_size * stages
            self._scheduler = SchedulerHalf(
                self.config,
                ident,
                block_size,
                workers,
                groups=groups,
                stages=stages,
                # Several batches in flight: a step is scheduled before the
                # last one's load failures are known (vLLM's engine core).
                overlapped=getattr(vllm_config, "max_concurrent_batches", 2) > 1,
            )
            events = getattr(vllm_config, "kv_events_config", None)
            if events is not None and events.enable_kv_cache_events:
                # The pool's blocks as KV events for routers (kv_events.py).
                parts = watched_parts(groups, ident, stages)
                self._events = KVEventsFeed(self.config.addr, parts)
        else:
            self._worker = WorkerHalf(
                self.config,
                ident,
                _tp_rank(vllm_config),
                tp_size,
                groups=groups,
                stage=_pp_rank(vllm_config) if stages > 1 else 0,
                stages=stages,
                settle_saves=_zeroes_before_preemptions(vllm_config, kv_cache_config),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep frees and remaps the KV memory the server has registered (and
        # may still copy into); without unregister/restore vLLM must refuse.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return None  # any block-compact layout; it is part of the namespace

    # -- scheduler side -----------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """The groups a hit restores: those we transfer (kv_groups.groups_of),
        so vLLM zeroes and replays exactly the others."""
        return tuple(rule.index for rule in self._groups.rules)

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        ids = blocks.get_block_ids()  # one list per KV cache group
        self._scheduler.after_alloc(request, ids, num_external_tokens)
        if self._events is not None:
            self._events.track(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(scheduler_output)
        if self._events is not None:  # the tokens of the blocks it saves
            self._events.note_saves(plan.saves)
        return PegaConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PegaWorkerMetadata):
            self._scheduler.on_worker_report(meta.report)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid KV manager: the one group's blocks."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """With it: block ids per group, positional, null blocks where a
        sliding window or a Mamba state moved on."""
        assert self._scheduler is not None
        if self._events is not None:
            self._events.finishing(request.request_id)
        return self._scheduler.request_finished(request, block_ids), None

    def take_events(self) -> list[Any]:
        """The server pool's BlockStored / BlockRemoved since the last step
        (vLLM publishes them with its own KV events)."""
        return self._events.take_events() if self._events is not None else []

    # -- worker side --------------------------------------------------------
    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PegaConnectorMetadata)
        return meta.plan

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        num_blocks = self._kv_cache_config.num_blocks
        self._worker.register(kv_caches, num_blocks, self._vllm_config)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Bound before every step's forward, whichever runner (its start_load_kv
        # comes after the forward when the step has no sync load).
        if self._worker is not None and isinstance(
            connector_metadata, PegaConnectorMetadata
        ):
            self._worker.step_began(connector_metadata.plan)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        assert isinstance(kv_connector_metadata, PegaConnectorMetadata)
        self._worker.handle_preemptions(kv_connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        # Attention layers call wait_for_layer_load from Python, only inside a
        # forward that carries attention metadata. A FULL CUDA graph replays
        # without Python: the V1 runner says so in the forward context, the
        # V2 runner passes the graph's metadata here as a keyword. Those steps,
        # and steps without a forward, wait for the whole sync load here.
        layer_waits = (
            getattr(forward_context, "attn_metadata", None) is not None
            and "attn_metadata" not in kwargs
            and getattr(forward_context, "cudagraph_runtime_mode", None)
            != CUDAGraphMode.FULL
        )
        self._worker.start_load(self._plan(), layer_waits)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # one Save per step for all layers, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._plan())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.33: finished transfers and the requests whose load failed
        (a hybrid model's failures; block-level ones come through
        get_block_ids_with_load_errors)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorTransferResults,
        )

        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending,
            finished_recving=recving,
            failed_recving=self._worker.take_failed_requests(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self._worker.take_report() if self._worker is not None else None
        return PegaWorkerMetadata(report) if report is not None else None

    # -- both ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> PegaConnectorStats | None:
        half = self._scheduler or self._worker
        stats = half.take_stats() if half is not None else None
        return PegaConnectorStats(data=stats) if stats is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> PegaConnectorStats:
        return PegaConnectorStats(data=dict(data) if data else new_stats())

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PegaPromMetrics:
        return PegaPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._events is not None:
            self._events.close()
