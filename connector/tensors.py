"""vLLM's per-layer KV tensors -> what the server registers, and the namespace.

vLLM 0.33 hands the worker one view per layer into a single int8 buffer, logical
[blocks, heads, block_size, content] in one of several physical orders, possibly
split into kernel blocks ([blocks * r, ...]); older vLLM gives K/V-first
[2, blocks, block_size, heads, head_size] tensors. Both reduce to "one page per
(layer, block)" for pegaflow.kv_layouts.describe.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KVTensors:
    tensors: tuple[Any, ...]  # per layer, manager block in dim 0 (dim 1 if kv_first)
    kv_first: bool
    device: str  # "cpu" or "cuda:N"
    # Everything about a page's bytes that two engines must share to exchange it.
    page_signature: tuple[object, ...]


def _page_signature(t: Any, skip: int) -> tuple[object, ...]:
    """Shape, element size and physical dim order of one block's page."""
    shape = tuple(t.shape[skip:])
    strides = tuple(t.stride()[skip:])
    # Size-1 dims have meaningless strides; leave them out of the order.
    dims = [d for d in range(len(shape)) if shape[d] > 1]
    order = tuple(sorted(dims, key=lambda d: -strides[d]))
    return (str(t.dtype), t.element_size(), shape, order)


def kv_tensors(kv_caches: Mapping[str, Any], num_blocks: int) -> KVTensors:
    """Group each layer's view by manager block, in vLLM's layer order."""
    if not kv_caches:
        raise ValueError("register_kv_caches: no KV cache tensors")
    out: list[Any] = []
    kinds: set[bool] = set()
    for name, t in kv_caches.items():
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            kinds.add(True)  # older vLLM: K and V as two tensors per layer
            out.append(t)
        elif t.dim() >= 2 and t.shape[0] % num_blocks == 0:
            kinds.add(False)
            ratio = t.shape[0] // num_blocks
            # Kernel blocks of one manager block are one strided run: view
            # them as [blocks, ratio, ...] (vLLM's group_kernel_blocks).
            out.append(t if ratio == 1 else t.unflatten(0, (num_blocks, ratio)))
        else:
            raise ValueError(
                f"KV cache {name!r}: shape {tuple(t.shape)} fits neither vLLM 0.33 "
                f"[blocks, heads, block_size, content] nor K/V-first "
                f"[2, blocks, ...] with {num_blocks} blocks"
            )
    if len(kinds) != 1:
        raise ValueError("KV caches mix K/V-first and block-first tensors")
    kv_first = kinds.pop()
    skip = 2 if kv_first else 1
    signatures = {_page_signature(t, skip) for t in out}
    if len(signatures) != 1:
        raise ValueError(
            "KV caches: layers differ in page shape or dtype (hybrid models need "
            "the hybrid KV manager, which PegaKVConnector does not support)"
        )
    devices = {str(t.device) for t in out}
    if len(devices) != 1:
        raise ValueError(f"KV caches span devices {sorted(devices)}")
    device = devices.pop()
    if device.startswith("cuda") and ":" not in device:
        device += ":0"
    return KVTensors(tuple(out), kv_first, device, (kv_first, *signatures.pop()))


def namespace_digest(parts: Mapping[str, object], secret: bytes = b"") -> str:
    """A stable name for 'these bytes mean the same thing'. With a tenant
    secret it is an HMAC keyed by the secret: without the secret nobody can
    compute it from the (guessable) parts, so nobody can ask for its blocks."""
    text = json.dumps(parts, sort_keys=True, default=str).encode()
    if secret:
        return "vllm-" + hmac.new(secret, text, hashlib.sha256).hexdigest()[:40]
    return "vllm-" + hashlib.sha256(text).hexdigest()[:40]


def namespace_parts(vllm_config: Any, kv: KVTensors, salt: str) -> dict[str, object]:
    """Everything that makes KV bytes incompatible between two engines."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    mla = bool(getattr(model, "use_mla", False))
    return {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "block_size": cache.block_size,
        "hash_algo": getattr(cache, "prefix_caching_hash_algo", None),
        "layers": len(kv.tensors),
        "page": kv.page_signature,  # KV heads per rank, head size, layout, dtype
        # MLA's latent KV is whole on every rank, the same at any TP size:
        # engines of any TP size share it.
        "tp_size": None if mla else par.tensor_parallel_size,
        "mla": mla,
        "salt": salt,
    }
