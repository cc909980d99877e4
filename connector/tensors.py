"""vLLM's per-layer KV tensors -> what the server registers, and the namespace.

vLLM 0.33 hands the worker one view per layer into a single int8 buffer, logical
[blocks, heads, block_size, content] in one of several physical orders, possibly
split into kernel blocks ([blocks * r, ...]); older vLLM gives K/V-first
[2, blocks, block_size, heads, head_size] tensors. Both reduce to "one page per
(layer, block)" for pegaflow.kv_layouts.describe.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import math
import re
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
            "KV caches: layers of one KV cache group differ in page shape or "
            f"dtype ({sorted(map(str, signatures))})"
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


# Keys of the effective (overridden) HF text config that change K or V of the
# same tokens without changing the page: the rotary embedding (applied to K
# before it is cached; theta and scaling live in rope_parameters since
# transformers 5, in rope_theta / rope_scaling before) and the attention span.
_KV_MATH_KEYS = (
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "partial_rotary_factor",
    "max_position_embeddings",  # the base length of dynamic / YaRN scaling
    "original_max_position_embeddings",
    "dual_chunk_attention_config",
    "sliding_window",  # None once disable_sliding_window is set
)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def canonical(value: Any) -> Any:
    """`value` as plain JSON data, the same in every process: mappings with
    string keys (json sorts them), sequences as lists, callables by qualified
    name, never a repr with an object address in it."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, set | frozenset):
        return sorted((canonical(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return canonical(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        return {f.name: canonical(getattr(value, f.name)) for f in fields}
    if hasattr(value, "to_dict"):  # transformers' PretrainedConfig and kin
        return canonical(value.to_dict())
    if hasattr(value, "model_dump"):  # pydantic models
        return canonical(value.model_dump())
    if callable(value):  # an hf_overrides function: its code, by name
        module = getattr(value, "__module__", None) or type(value).__module__
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"{module}.{name}"
    # torch.dtype and other values with a stable str; an object's default
    # repr names its address, which differs per process.
    return _ADDRESS.sub("", str(value))


def namespace_parts(vllm_config: Any, kv: KVTensors, salt: str) -> dict[str, object]:
    """Everything that makes KV bytes incompatible between two engines."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    mla = bool(getattr(model, "use_mla", False))
    text_config = getattr(model, "hf_text_config", None)
    load = getattr(vllm_config, "load_config", None)
    return {
        "model": model.model,
        "revision": getattr(model, "revision", None),
        # Other weights, modelling code or model class for the same name.
        "weights": getattr(model, "model_weights", "") or None,
        "code_revision": getattr(model, "code_revision", None),
        "model_class_overrides": canonical(getattr(model, "model_class_overrides", {})),
        "dummy_weights": getattr(load, "load_format", None) == "dummy",
        "dtype": str(model.dtype),
        # Quantized weights compute other activations, hence other K and V.
        "quantization": getattr(model, "quantization", None),
        "quantization_config": canonical(getattr(model, "quantization_config", None)),
        # As the user gave them; their effect on the config is in kv_math.
        "hf_overrides": canonical(getattr(model, "hf_overrides", {})),
        "kv_math": {k: canonical(getattr(text_config, k, None)) for k in _KV_MATH_KEYS},
        "cache_dtype": str(cache.cache_dtype),
        "cache_dtype_skip_layers": canonical(
            getattr(cache, "kv_cache_dtype_skip_layers", [])
        ),
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
