"""Connector statistics through vLLM's hooks: `KVConnectorStats` for the
periodic "KV Transfer metrics" log line, Prometheus counters per engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from .step_plan import STAT_KEYS, new_stats

DOCS = {
    "queries": "Prefix queries sent to pegaflow-server",
    "query_seconds": "Seconds spent in prefix queries",
    "query_failures": "Prefix queries that failed (counted as misses)",
    "query_tokens": "Tokens asked about beyond the local prefix-cache hit",
    "hit_tokens": "Tokens loaded from pegaflow instead of computed",
    "load_blocks": "Blocks loaded from pegaflow",
    "load_bytes": "Bytes loaded from pegaflow",
    "load_seconds": "Seconds spent in Load calls",
    "load_failures": "Failed loads (blocks recomputed)",
    "layerwise_loads": "Sync loads the forward waited for layer by layer",
    "save_blocks": "Blocks stored in pegaflow",
    "save_bytes": "Bytes stored in pegaflow",
    "save_seconds": "Seconds spent in Save calls",
    "save_failures": "Failed saves (future misses)",
    "saves_skipped": "Blocks not saved while the server was away",
    "planner_loaded_tokens": "Hit tokens the fetch planner chose to load",
    "planner_recomputed_tokens": "Hit tokens the fetch planner chose to recompute",
    "planner_predicted_load_seconds": "The planner's predicted time of loads it chose",
    "planner_gave_up": "Waits for a slower tier given up (it was late)",
}


@dataclass
class PegaConnectorStats(KVConnectorStats):
    """`data` holds counters (plan.STAT_KEYS), summed across workers/steps."""

    def reset(self) -> None:
        self.data = new_stats()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = {key: self.data.get(key, 0) for key in STAT_KEYS}
        return {
            "queries": int(d["queries"]),
            "query_avg_ms": round(1e3 * d["query_seconds"] / max(1, d["queries"]), 3),
            "hit_tokens": int(d["hit_tokens"]),
            "hit_rate": round(d["hit_tokens"] / max(1, d["query_tokens"]), 4),
            "load_MB": round(d["load_bytes"] / 1e6, 3),
            "load_GBps": round(d["load_bytes"] / 1e9 / max(1e-9, d["load_seconds"]), 3),
            "save_MB": round(d["save_bytes"] / 1e6, 3),
            "save_GBps": round(d["save_bytes"] / 1e9 / max(1e-9, d["save_seconds"]), 3),
            "failures": int(
                d["query_failures"] + d["load_failures"] + d["save_failures"]
            ),
        }

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PegaPromMetrics(KVConnectorPromMetrics):
    """One counter per statistic, `vllm:pegaflow_<name>`, labelled per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key in STAT_KEYS:
            metric = self._counter_cls(
                name=f"vllm:pegaflow_{key}",
                documentation=DOCS[key],
                labelnames=labelnames,
            )
            self._counters[key] = {
                idx: metric.labels(*values)
                for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
