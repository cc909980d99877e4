"""Parts of benchmarks/transfer.py that need no server: pool bring-up through
pegaflow's own HostPool + CUDA registrar, and the prefill time of a 10K-token
prompt on a random-initialised Llama-3.1-8B-shaped model.

The prefill model is plain torch (bf16 weights drawn at random on the GPU, RMS
norm, rotary embedding, GQA attention through SDPA, SwiGLU MLP, last-token
logits): transformers is not installed on the GPU machine, and this runs the
same matrix work as its LlamaModel for one forward pass.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from pegaflow.cache.pool import HostPool
from pegaflow.common.cuda_driver import HostRegistrar
from pegaflow.common.settings import PoolConfig

# Llama-3.1-8B
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD = 4096, 32, 32, 8, 128
FFN, VOCAB = 14336, 128256


def bring_up(gib: int) -> dict:
    """Allocate + pre-touch + cudaHostRegister a pool of `gib` GiB, timed; with
    one registration call, then with 8 GiB chunks registered from 8 threads."""
    out: dict[str, object] = {"bringup_GiB": gib}
    for label, registrar in (
        ("serial", HostRegistrar(0)),
        ("parallel", HostRegistrar(0, chunk_bytes=8 << 30, threads=8)),
    ):
        start = time.perf_counter()
        config = PoolConfig(size_bytes=gib << 30, prefault_threads=16)
        pool = HostPool(dataclasses.replace(config, show_progress=False), registrar)
        seconds = time.perf_counter() - start
        touch = pool.bring_up.seconds
        pool.close()
        out[f"bringup_{label}_s"] = round(seconds, 2)
        out[f"bringup_{label}_GBps"] = round((gib << 30) / seconds / 1e9, 1)
        out[f"bringup_{label}_touch_s"] = round(touch, 2)
        out[f"bringup_{label}_register_s"] = round(seconds - touch, 2)
    return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _layer(h: torch.Tensor, w: dict, cos: torch.Tensor, sin: torch.Tensor) -> None:
    t = h.shape[0]
    x = F.rms_norm(h, (HIDDEN,))
    q = (x @ w["q"]).view(1, t, HEADS, HEAD).transpose(1, 2)
    k = (x @ w["k"]).view(1, t, KV_HEADS, HEAD).transpose(1, 2)
    v = (x @ w["v"]).view(1, t, KV_HEADS, HEAD).transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    # Plain 4-D MHA layout (KV heads repeated), which SDPA's flash kernel takes;
    # a first run with 3-D inputs and enable_gqa took 2.8 s (~50 TFLOP/s).
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h += a.transpose(1, 2).reshape(t, HIDDEN) @ w["o"]
    x = F.rms_norm(h, (HIDDEN,))
    h += (F.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


@torch.inference_mode()
def prefill_seconds(tokens: int, reps: int = 3) -> float:
    """Best of `reps` forward passes over `tokens` tokens (weights ~16 GB)."""
    dev, dt = "cuda", torch.bfloat16
    shapes = {
        "q": (HIDDEN, HEADS * HEAD),
        "k": (HIDDEN, KV_HEADS * HEAD),
        "v": (HIDDEN, KV_HEADS * HEAD),
        "o": (HEADS * HEAD, HIDDEN),
        "gate": (HIDDEN, FFN),
        "up": (HIDDEN, FFN),
        "down": (FFN, HIDDEN),
    }
    layers = [
        {n: torch.randn(s, device=dev, dtype=dt) * 0.02 for n, s in shapes.items()}
        for _ in range(LAYERS)
    ]
    embed = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt) * 0.02
    ids = torch.randint(0, VOCAB, (tokens,), device=dev)
    pos = torch.arange(tokens, device=dev, dtype=torch.float32)[:, None]
    inv = 500000.0 ** (-torch.arange(0, HEAD, 2, device=dev) / HEAD)
    cos, sin = (f(pos * inv).to(dt) for f in (torch.cos, torch.sin))
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        h = embed[ids]
        for w in layers:
            _layer(h, w, cos, sin)
        logits = F.rms_norm(h[-1:], (HIDDEN,)) @ embed.T
        logits.argmax().item()  # completion seen by the host
        best = min(best, time.perf_counter() - start)
    del layers, embed
    torch.cuda.empty_cache()
    return best
