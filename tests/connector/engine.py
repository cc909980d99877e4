"""A vLLM 0.33 engine on CPU without a model: the real Scheduler (and its
SCHEDULER-role PegaKVConnector), a WORKER-role connector holding real KV views
from vLLM's `allocate_kv_cache`, and a fake forward that writes known bytes.

The fake KV of token position p is a function of tokens[0..p] only (a rolling
hash), as real attention KV is, so two engines that compute the same prefix
write the same bytes, and a loaded page can be checked against that function
(fake_kv.py; the checks: page_checks.py). MLA pages are one head wide, also
as the 3-D [blocks, block_size, head_dim] of MLA's kernels (`mla_3d`).

`specs` (layer name -> vLLM KVCacheSpec) builds a hybrid model: vLLM's hybrid KV
manager groups the layers, each group with its own block table; a layer's fake
KV goes to its group's blocks (never to a null block). A Mamba layer's fake
state after token p is a function of tokens[0..p]; a step reads the state it
starts from (at a block boundary: the block before it, as vLLM's align mode
keeps it) and checks it, then writes its end state into the block it ends in.
A bounded-replay window (DeepSeek-V4) is rebuilt by replaying a hit's last
window: the replay writes that group only, as vLLM's runner does.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    CUDAGraphMode,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from pegaflow.connector import PegaKVConnector
from tests.connector.fake_kv import BLOCK, Seq, fake_kv_batch, fake_state, pages
from tests.connector.page_checks import PageChecks

# Engines of the running test, closed at its end if it did not (conftest's
# close_engines): one left open keeps its I/O threads, its liveness session
# and the memfd its KV was shared through into every later test.
OPEN_ENGINES: list[Engine] = []

LAYERS = 4
KV_HEADS = 2
HEAD = 16
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def model_dir(root: Path, layers: int = LAYERS, kv_heads: int = KV_HEADS) -> Path:
    path = root / f"tiny-llama-{layers}x{kv_heads}"
    path.mkdir(exist_ok=True)
    model = {**MODEL, "num_hidden_layers": layers, "num_key_value_heads": kv_heads}
    (path / "config.json").write_text(json.dumps(model))
    return path


def vllm_config(
    model: Path,
    extra: dict | None = None,
    max_len: int = 512,
    connector: bool = True,
    **sched: Any,
) -> VllmConfig:
    transfer = KVTransferConfig(
        kv_connector="PegaKVConnector",
        kv_connector_module_path="pegaflow.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra or {},
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, max_model_len=max_len
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=sched.get("max_num_seqs", 16),
            max_num_batched_tokens=sched.get("max_num_batched_tokens", 512),
            max_model_len=max_len,
            is_encoder_decoder=False,
            async_scheduling=sched.get("async_scheduling"),
            long_prefill_token_threshold=sched.get("long_prefill_token_threshold", 0),
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=transfer if connector else None,
    )


class Engine(PageChecks):
    """Scheduler + worker connector in one process, stepped by hand."""

    scheduler_cls: type[Scheduler] = Scheduler

    def __init__(
        self,
        config: VllmConfig,
        layout: str = "LBNHC",
        num_blocks: int = 128,
        write_kv: bool = True,
        spec_decode_order: bool = False,
        full_cuda_graph: bool = False,
        specs: dict[str, Any] | None = None,
        stages: int = 1,
        forward_s_per_token: float = 0.0,
        v2_runner: bool = False,
        untransferred: tuple[int, ...] = (),
        mla_3d: bool = False,
    ) -> None:
        self.config = config
        self.closed = False
        # As vLLM 0.33's V2 model runner: blocks the step allocates are zeroed
        # (Mamba, mixed-precision KV) before the connector's handle_preemptions.
        self.v2_runner = v2_runner
        self.write_kv = write_kv  # off: scheduling only (benchmarks)
        # A slower model: the fake forward takes this long per scheduled token.
        self.forward_s_per_token = forward_s_per_token
        # As vLLM's runners with speculative decoding: transfer results are
        # collected before wait_for_save, which waits for the drafter.
        self.spec_decode_order = spec_decode_order
        # As the V1 runner replaying a FULL CUDA graph: the forward context
        # says FULL and no Python runs per layer (no wait_for_layer_load), so
        # a sync load must have landed when start_load_kv returns (checked).
        self.full_cuda_graph = full_cuda_graph
        config.cache_config.kv_cache_layout = layout
        config.parallel_config.pipeline_parallel_size = stages
        hf = config.model_config.hf_config
        if specs is None:
            spec = FullAttentionSpec(
                block_size=BLOCK,
                num_kv_heads=hf.num_key_value_heads,
                head_size=HEAD,
                dtype=torch.bfloat16,
            )
            layers = hf.num_hidden_layers
            specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}
        else:  # vLLM turns its hybrid manager off on a CPU platform
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
        groups = get_global_kv_cache_groups(config, [specs])
        page = max(spec.page_size_bytes for spec in specs.values())
        memory = num_blocks * page * len(specs)
        configs = get_kv_cache_configs(config, [specs], [memory], groups)
        self.kv_cache_config = configs[0]
        # Groups vLLM keeps out of KV transfer (HiSparse's replicas, rebuilt
        # from the source group after a load): the connector never sees them.
        for g in untransferred:
            self.kv_cache_config.kv_cache_groups[g].enable_kv_transfer = False
        self.group_of = {
            name: g
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups)
            for name in group.layer_names
        }
        self.state_layers = {
            name
            for group in self.kv_cache_config.kv_cache_groups
            if isinstance(group.kv_cache_spec, MambaSpec)
            for name in group.layer_names
        }
        # A window vLLM rebuilds after a hit by replaying the hit's last
        # window of tokens (DeepSeek-V4's bounded replay): never loaded, so
        # written only by the forward (checked: replay_changes).
        self.replay_groups = {
            g
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups)
            if getattr(group.kv_cache_spec, "prefix_replay_tokens", 0)
        }
        self.replay_layers = {
            n for n in self.group_of if self.group_of[n] in self.replay_groups
        }
        self._replay_snap: dict[str, tuple[list[int], torch.Tensor]] = {}
        # Per-request scratch (a compressor's ring): no hit restores it, so
        # the fake forward neither writes nor checks it.
        self.scratch_layers = {
            name
            for group in self.kv_cache_config.kv_cache_groups
            if not group.kv_cache_spec.prefix_cacheable
            for name in group.layer_names
        } - self.replay_layers
        config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.sched = self.scheduler_cls(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.caches = allocate_kv_cache(
            self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout]
        )
        self.replay_window = getattr(self.sched, "prefix_replay_tokens", 0)
        if mla_3d:  # MLA as its kernels (and older vLLM) view it: [B, N, C]
            for name, group in self.group_of.items():
                spec = self.kv_cache_config.kv_cache_groups[group].kv_cache_spec
                if isinstance(spec, MLAAttentionSpec | SlidingWindowMLASpec):
                    self.caches[name] = self.caches[name].squeeze(1)
        # Pipeline stage s runs the s-th slice of the layers, in its own
        # WORKER-role connector (vLLM: its own process); outputs are
        # aggregated as vLLM's executor does.
        names = list(self.caches)
        per = -(-len(names) // stages)
        self.stage_layers = [names[s * per : (s + 1) * per] for s in range(stages)]
        self.workers: list[Any] = []  # none: the baseline of the benchmarks
        if config.kv_transfer_config is not None:
            for s, layers in enumerate(self.stage_layers):
                stage_config = copy.copy(config)
                stage_config.parallel_config = copy.copy(config.parallel_config)
                stage_config.parallel_config.rank = s
                w = PegaKVConnector(
                    stage_config, KVConnectorRole.WORKER, self.kv_cache_config
                )
                w.register_kv_caches({n: self.caches[n] for n in layers})
                self.workers.append(w)
        self.worker: Any = self.workers[0] if self.workers else None
        self.aggregator = KVOutputAggregator(max(len(self.workers), 1))
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.seqs: dict[str, Seq] = {}
        self.outputs: dict[str, list[int]] = {}
        self.seen_waiting_remote: set[str] = set()
        self.stats: list[dict] = []
        self.errors: list[str] = []  # pages of finished requests with wrong bytes
        self.after_schedule: Any = None  # test hook: (scheduler_output) -> None
        self.timing: list[tuple[float, float]] = []  # (scheduler s, worker s)
        self.steps = 0
        OPEN_ENGINES.append(self)

    @property
    def scheduler_connector(self) -> Any:
        return self.sched.connector

    def planner_rate(self) -> float:
        """The prefill rate the scheduler's fetch planner has learnt."""
        return self.scheduler_connector._scheduler.planner.prefill_tokens_per_s

    def add(self, rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
        req = Request(
            request_id=rid,
            prompt_token_ids=list(tokens),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.seqs[rid] = Seq(list(tokens))
        self.sched.add_request(req)
        return req

    # -- one engine step ------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """schedule -> worker connector around a fake forward -> update."""
        so, tables, mro = self.execute()
        finished = self.update(so, tables, mro)
        return {"scheduled": dict(so.num_scheduled_tokens), "finished": finished}

    def execute(self) -> tuple[Any, dict[str, list[list[int]]], ModelRunnerOutput]:
        """Schedule a step and run the worker's side of it."""
        t0 = time.perf_counter()
        so = self.sched.schedule()
        self._t_sched = time.perf_counter() - t0
        self.steps += 1
        if self.after_schedule is not None:
            self.after_schedule(so)
        for req in [*self.sched.waiting, *self.sched.kv_holding_waiting]:
            if req.status.name == "WAITING_FOR_REMOTE_KVS":
                self.seen_waiting_remote.add(req.request_id)
        tables = {rid: self.tables(rid) for rid in so.num_scheduled_tokens}
        if self.write_kv:
            self.errors += self.restored_errors(so, tables) + self.replay_changes()
        t2 = time.perf_counter()
        out = self._worker_step(so, tables)
        self._t_worker = time.perf_counter() - t2
        ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[self._sample(rid) for rid in ids],
            kv_connector_output=out,
        )
        return so, tables, mro

    def update(
        self, so: Any, tables: dict[str, list[list[int]]], mro: ModelRunnerOutput
    ) -> dict[str, list[list[int]]]:
        """The scheduler takes a step's output; returns the finished requests."""
        t4 = time.perf_counter()
        engine_outputs = self.sched.update_from_output(so, mro)
        t5 = time.perf_counter()
        self.timing.append((self._t_sched + t5 - t4, self._t_worker))
        finished = {}
        for outputs in engine_outputs.values():
            # Worker and scheduler stats, merged by vLLM as for its logger.
            sched_stats = outputs.scheduler_stats
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.stats.append(dict(sched_stats.kv_connector_stats))
            for o in outputs.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    finished[o.request_id] = table = tables[o.request_id]
                    # Check now: the freed blocks may be reused next step.
                    if self.write_kv:
                        kv_tokens = len(self.seqs[o.request_id].tokens) - 1
                        self.errors += self.page_errors(o.request_id, table, kv_tokens)
        return finished

    def _worker_step(
        self, so: Any, tables: dict[str, list[list[int]]]
    ) -> KVConnectorOutput | None:
        """Each stage's worker around its part of the forward, then vLLM's
        aggregation of their outputs (a request is done when all say so)."""
        if not self.workers:
            self._forward(so, tables, None, list(self.caches))
            return None
        if len(self.workers) == 1:
            return self._stage_step(self.workers[0], so, tables, list(self.caches))
        outs = [
            ModelRunnerOutput(
                req_ids=[],
                req_id_to_index={},
                kv_connector_output=self._stage_step(w, so, tables, layers),
            )
            for w, layers in zip(self.workers, self.stage_layers, strict=True)
        ]
        return self.aggregator.aggregate(outs).kv_connector_output

    def _stage_step(
        self, w: Any, so: Any, tables: dict[str, list[list[int]]], layers: list[str]
    ) -> KVConnectorOutput:
        """What vLLM 0.33's model runner does around the forward, in order."""
        meta = so.kv_connector_metadata
        if self.v2_runner and so.new_block_ids_to_zero:
            ids = torch.tensor(so.new_block_ids_to_zero)
            for name in layers:
                self.caches[name][ids] = 0
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:  # sync loads start before the forward
            mode = CUDAGraphMode.FULL if self.full_cuda_graph else CUDAGraphMode.NONE
            context = SimpleNamespace(
                attn_metadata={"attn": True}, cudagraph_runtime_mode=mode
            )
            w.start_load_kv(context)
            if self.full_cuda_graph:
                self.errors += self.sync_load_errors(meta.plan.loads)
        self._forward(so, tables, None if self.full_cuda_graph else w, layers)
        if not so.has_sync_kv_loads:
            w.start_load_kv(SimpleNamespace(attn_metadata=None))
        if not self.spec_decode_order:
            w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )
        if self.spec_decode_order:  # after the drafter's forward
            w.wait_for_save()
        w.clear_connector_metadata()
        return out

    def _forward(
        self, so: Any, tables: dict[str, list[list[int]]], w: Any, names: list[str]
    ) -> None:
        if self.forward_s_per_token:
            time.sleep(self.forward_s_per_token * so.total_num_scheduled_tokens)
        for layer, name in enumerate(self.caches):
            if name not in names:
                continue  # another stage's layer
            if w is not None:
                w.wait_for_layer_load(name)
            if self.write_kv and name not in self.scratch_layers:
                for rid, n in so.num_scheduled_tokens.items():
                    table = tables[rid][self.group_of[name]]
                    if name in self.state_layers:
                        self._write_state(rid, n, layer, self.caches[name], table)
                        continue
                    # vLLM's runner pads the replayed tokens' slots in the
                    # groups a hit restored: their cached KV stays as is.
                    keep = (
                        range(0) if name in self.replay_layers else self.replayed(rid)
                    )
                    self._write(rid, n, layer, self.caches[name], table, keep)
            if w is not None:
                w.save_kv_layer(name, self.caches[name], None)
        if self.write_kv and self.replay_layers:  # before the step's async loads
            owned = self._replay_owned()
            for name in self.replay_layers.intersection(names):
                g = self.group_of[name]
                ids = sorted(b for group, b in owned if group == g)
                self._replay_snap[name] = (ids, pages(self.caches[name])[ids].clone())

    def table(self, rid: str) -> list[int]:
        return self.tables(rid)[0]

    def _write(
        self, rid: str, n: int, layer: int, view: Any, table: list[int], keep: range
    ) -> None:
        req = self.sched.requests[rid]
        start = req.num_computed_tokens - n  # the scheduler already advanced it
        seq = self.seqs[rid]
        self.track_tokens(rid, seq)
        pos = list(range(start, start + n))
        if layer == 0:
            seq.computed.extend(pos)
        pos = [p for p in pos if p not in keep]
        if not pos:
            return
        kv = pages(view)
        values = torch.tensor([seq.value(p) for p in pos], dtype=torch.int64)
        blocks = torch.tensor([table[p // BLOCK] for p in pos])
        assert int(blocks.min()) > 0, f"{rid}: a computed token in a null block"
        slots = torch.tensor([p % BLOCK for p in pos])
        kv[blocks, :, slots, :] = fake_kv_batch(values, layer, kv.shape[1], kv.shape[3])

    def _write_state(
        self, rid: str, n: int, layer: int, view: Any, table: list[int]
    ) -> None:
        req = self.sched.requests[rid]
        start = req.num_computed_tokens - n
        seq = self.seqs[rid]
        self.track_tokens(rid, seq)
        if layer == 0:
            seq.computed.extend(range(start, start + n))
        pages = view.reshape(view.shape[0], -1).view(torch.int16)
        if start and start % BLOCK == 0:
            src = table[start // BLOCK - 1] if start // BLOCK <= len(table) else 0
            want = fake_state(seq.value(start - 1), layer, pages.shape[1])
            if src == 0 or not torch.equal(pages[src], want):
                self.errors.append(f"{rid} layer {layer}: state at {start} (id {src})")
        end = start + n
        dst = table[(end - 1) // BLOCK]
        assert dst > 0, f"{rid}: a computed state in a null block"
        pages[dst] = fake_state(seq.value(end - 1), layer, pages.shape[1])

    def track_tokens(self, rid: str, seq: Seq) -> None:
        """The tokens the worker knows of: the scheduler's, in turn."""
        seq.tokens = list(self.sched.requests[rid].all_token_ids)

    def _sample(self, rid: str) -> list[int]:
        req = self.sched.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            return []  # a prefill chunk: nothing sampled
        seq = self.seqs[rid]
        self.track_tokens(rid, seq)
        return [seq.value(req.num_tokens - 1) % 900 + 50]

    def idle(self) -> bool:
        """Every request finished and every held block back."""
        s = self.sched
        return not (s.has_unfinished_requests() or s.has_finished_requests())

    def run(self, max_steps: int = 2000) -> dict[str, list[int]]:
        """Step until idle()."""
        finished: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if self.idle():
                return finished
            result = self.step()
            finished.update(result["finished"])
            if not result["scheduled"]:
                time.sleep(0.002)  # waiting on async transfers
        raise AssertionError(f"not done after {max_steps} steps")

    def assert_clean(self) -> None:
        s = self.sched
        assert not s.requests, f"leaked requests {list(s.requests)}"
        assert not s.running and len(s.waiting) == 0
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        assert free == self.kv_cache_config.num_blocks - 1, "leaked blocks"
        if s.connector is None:
            return
        half = s.connector._scheduler
        assert not half._reqs and not half._hits and not half._loads
        assert not half._holes, "holes left of requests gone"
        for w in self.workers:
            worker = w._worker
            assert not worker._saves and not worker._recving and not worker._held

    def counters(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for entry in self.stats:
            for key, value in entry.items():
                total[key] = total.get(key, 0) + value
        return total

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self in OPEN_ENGINES:
            OPEN_ENGINES.remove(self)
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()
