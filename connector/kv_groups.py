"""vLLM's KV cache groups as the connector sees them: one rule per group.

A hybrid model (full + sliding-window attention, chunked local attention, Mamba
state) has several KV cache groups, each with its own spec, block size and
block table. To the server each group is a part of its own: its own instance
(`part_instance`) and namespace, since its pages have their own geometry. A hit
of P tokens is claimed only when every group can be restored at P (and, under
pipeline parallelism, every stage: each stage's layers are a part too):

- full attention (and MLA): every block of the prefix;
- sliding window: the blocks the window at P still sees, from
  `first_needed_token(P)` on (vLLM hands null blocks for the rest);
- chunked local attention: the blocks of P's chunk;
- Mamba (`mamba_cache_mode="align"`): the state cached at the boundary P, one
  block.

Only the groups vLLM restores from a hit are rules (`groups_of`): a scratch
ring or a window vLLM rebuilds by replay is none of our business.

Pure Python: the rules travel to the worker half and into the tests without
vLLM; only `groups_of` reads vLLM's spec classes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .vllm_compat import sliding_window_retained_tokens

GroupKind = Literal["full", "sliding", "chunked", "mamba"]
NULL_BLOCK = 0  # vLLM's null block: a skipped position, never saved or loaded


@dataclass(frozen=True, slots=True)
class GroupRule:
    index: int  # vLLM's kv_cache_group_id: the position in block-id tuples
    kind: GroupKind
    block_size: int  # tokens per block of this group
    # sliding: tokens below P the window keeps (window - 1 + extra retained);
    # chunked: the chunk size; otherwise unused.
    span: int
    layer_names: tuple[str, ...]
    # Bytes of one block over the group's layers, on one worker (0: unknown;
    # the fetch planner then loads every hit).
    block_bytes: int = 0

    def first_needed_token(self, num_tokens: int) -> int:
        """The first token whose KV a request restored at `num_tokens` reads."""
        if self.kind == "sliding":
            return max(0, num_tokens - self.span)
        if self.kind == "chunked":
            return num_tokens // self.span * self.span
        if self.kind == "mamba":
            return max(0, num_tokens - self.block_size)
        return 0

    @property
    def volatile(self) -> bool:
        """vLLM may free this group's blocks while the request still runs (the
        window moves on, an older Mamba state is dropped): a save of them must
        end before the next forward can reuse them."""
        return self.kind != "full"

    @property
    def sparse(self) -> bool:
        """Saved at some block boundaries only (Mamba states): a prefix query
        cannot find them, each boundary is asked for on its own."""
        return self.kind == "mamba"


@dataclass(frozen=True, slots=True)
class KVGroups:
    rules: tuple[GroupRule, ...]
    hash_block_size: int  # tokens per entry of request.block_hashes
    alignment: int  # a hit's length is a multiple of this many tokens
    # vLLM's KV cache groups, transferred or not (HiSparse keeps its GPU
    # replicas out of transfer): the rules may be fewer.
    vllm_groups: int = 1

    @property
    def hybrid(self) -> bool:
        return len(self.rules) > 1

    @property
    def several(self) -> bool:
        """vLLM has several KV cache groups, whatever we transfer: a block id
        names a block only within its group, so vLLM takes a failed load per
        request (failed_recving, async loads only), never by block id, and
        a worker's layers are those of the transferred groups only."""
        return max(self.vllm_groups, len(self.rules)) > 1

    def rule(self, index: int) -> GroupRule:
        for rule in self.rules:
            if rule.index == index:
                return rule
        raise KeyError(f"KV cache group {index} is not transferred")

    def hashes(self, rule: GroupRule, block_hashes: Sequence[bytes]) -> list[bytes]:
        """This group's block hashes: a group block of k hash blocks is named
        by the chained hash of its last one (it covers the whole prefix)."""
        k = rule.block_size // self.hash_block_size
        return list(block_hashes) if k == 1 else list(block_hashes[k - 1 :: k])

    def part_instance(
        self, instance_id: str, rule: GroupRule, stage: int = 0, stages: int = 1
    ) -> str:
        """The server instance holding this group's pages of this pipeline
        stage's layers (the engine's own id for one group and one stage)."""
        name = instance_id if stages == 1 else f"{instance_id}-pp{stage}"
        return name if not self.hybrid else f"{name}-g{rule.index}"


def single_group(block_size: int, layer_names: Sequence[str] = ()) -> KVGroups:
    """A model with one full-attention group (what the tests and tools use
    when they build the halves without vLLM)."""
    rule = GroupRule(0, "full", block_size, 0, tuple(layer_names))
    return KVGroups((rule,), block_size, block_size)


def groups_of(kv_cache_config: Any, block_size: int) -> KVGroups:
    """The groups of vLLM's KVCacheConfig it restores from an external hit,
    or ValueError naming one this connector cannot restore (its spec and
    layers). vLLM restores the prefix-cacheable transfer groups only (its
    default get_loaded_kv_cache_group_ids); the others are per-request
    scratch (a compressor's ring) or rebuilt by replaying the hit's last
    window, so a copy of them would be loaded for nothing."""
    configs = kv_cache_config.kv_cache_groups
    restored = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if restored is None:  # before vLLM 0.33, or a stand-in config
        transfer = getattr(kv_cache_config, "transfer_group_ids", range(len(configs)))
        restored = [
            i
            for i in transfer
            if getattr(configs[i].kv_cache_spec, "prefix_cacheable", True)
        ]
    rules = tuple(
        dataclasses.replace(_rule(i, configs[i]), block_bytes=_block_bytes(configs[i]))
        for i in restored
    )
    if not rules:
        raise ValueError("PegaKVConnector: no KV cache group to transfer")
    hash_bs = getattr(kv_cache_config, "hash_block_size", None) or block_size
    alignment = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or 1
    for rule in rules:
        if rule.block_size % hash_bs:
            raise ValueError(
                f"PegaKVConnector: KV cache group {rule.index} has block size "
                f"{rule.block_size}, not a multiple of the hash block size {hash_bs}"
            )
        alignment = math.lcm(alignment, rule.block_size)
    return KVGroups(rules, hash_bs, alignment, len(configs))


def _block_bytes(group: Any) -> int:
    """One block of every layer of the group, as one worker holds it."""
    spec = group.kv_cache_spec
    try:
        each = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if each:
            return int(sum(s.page_size_bytes for s in each.values()))
        return int(spec.page_size_bytes) * len(group.layer_names)
    except (AttributeError, TypeError, ValueError):  # a spec without a page size
        return 0


def _rule(index: int, group: Any) -> GroupRule:
    from vllm.v1 import kv_cache_interface as kvi

    spec = group.kv_cache_spec
    names = tuple(group.layer_names)
    if isinstance(spec, kvi.UniformTypeKVCacheSpecs):  # same kind, several shapes
        kinds = {type(s) for s in spec.kv_cache_specs.values()}
        spec = next(iter(spec.kv_cache_specs.values())) if len(kinds) == 1 else spec
    kind = type(spec)
    shown = ", ".join(names[:4]) + (
        f" and {len(names) - 4} more" if len(names) > 4 else ""
    )
    refuse = f"PegaKVConnector: KV cache group {index} ({kind.__name__}: {shown})"
    if getattr(group, "is_eagle_group", False):
        raise ValueError(f"{refuse} holds speculative-decoding draft layers")
    if kind in (kvi.FullAttentionSpec, kvi.MLAAttentionSpec):
        return GroupRule(index, "full", spec.block_size, 0, names)
    if kind in (kvi.SlidingWindowSpec, kvi.SlidingWindowMLASpec):
        span = sliding_window_retained_tokens(spec)
        return GroupRule(index, "sliding", spec.block_size, span, names)
    if kind is kvi.ChunkedLocalAttentionSpec:
        chunk = spec.attention_chunk_size
        return GroupRule(index, "chunked", spec.block_size, chunk, names)
    if kind is kvi.MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise ValueError(
                f"{refuse} caches Mamba state in mode {spec.mamba_cache_mode!r}; "
                "prefix caching of Mamba state needs mamba_cache_mode='align'"
            )
        if spec.num_speculative_blocks:
            raise ValueError(f"{refuse} has speculative Mamba state blocks")
        return GroupRule(index, "mamba", spec.block_size, 0, names)
    raise ValueError(
        f"{refuse} cannot be restored from a prefix cache; supported: full "
        "attention, MLA, sliding window, chunked local attention, Mamba "
        "(mamba_cache_mode='align')"
    )
