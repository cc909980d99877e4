"""Tiny models written by the tests: a config.json and safetensors of random
weights drawn N(0, 1/fan_in), so every layer passes on a signal of the same
size and the logits differ per token (vLLM's `dummy` loader fills weights with
tiny uniform values: every logit equal, and outputs that cannot see wrong KV).

No hub: transformers builds the architecture from the config (its parameter
names are the checkpoint's), the weights are redrawn from a fixed seed, and
vLLM loads the directory with skip_tokenizer_init (prompts are token ids).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 2048
SEED = 29


def _fan_in(module: Any, name: str, shape: tuple[int, ...]) -> int:
    """Inputs summed into one output of the parameter `name` of `module`."""
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return module.in_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        return math.prod(shape[1:])
    # Fused expert weights ([experts, in, out] or [experts, out, in]): the
    # smaller of the two, which errs towards a larger signal, never a vanishing one.
    return min(shape[-2:])


def _write(path: Path, config: Any, dtype: str) -> Path:
    """Build the model from `config`, redraw every weight matrix, save it."""
    import torch
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path  # written earlier in this session
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        modules = dict(model.named_modules())
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:  # norms, biases, SSM constants: as built
                continue
            owner = modules[name.rpartition(".")[0]]
            std = 1.0 / math.sqrt(_fan_in(owner, name, tuple(param.shape)))
            draw = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_((draw * std).to(param.dtype))
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path, safe_serialization=True)
    # save_pretrained writes the transformers defaults too; vLLM reads this.
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def llama(root: Path, hidden: int = 256, layers: int = 4, kv_heads: int = 2) -> Path:
    """Default: 4 layers, 2 KV heads of 64, a 64 KiB page per 32-token block
    (fp32). benchmarks/real_engine_ttft.py asks for a larger one."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2 if hidden <= 256 else hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    name = "tiny-llama" if (hidden, layers) == (256, 4) else f"llama-{hidden}x{layers}"
    return _write(root / name, config, "float32")


def gemma3(root: Path) -> Path:
    """Sliding window 128 on two layers, full attention on two: vLLM builds a
    SlidingWindowSpec and a FullAttentionSpec group. Half the layers full, so
    the first block's tokens still move the output of a long prompt."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=128,
        layer_types=[
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        max_position_embeddings=4096,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )
    return _write(root / "tiny-gemma3", config, "float32")


def gpt_oss(root: Path) -> Path:
    """Sliding (128) and full attention alternating, 4 experts of which 2 run."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        # rope_parameters: the default YaRN ones (vLLM's gpt-oss reads them)
    )
    return _write(root / "tiny-gpt-oss", config, "bfloat16")


def qwen3_next(root: Path) -> Path:
    """Gated DeltaNet (linear attention: MambaSpec groups, align mode) on two
    layers, full attention on two. The CPU build needs bf16, linear key/value
    head dims 128 and at least one MoE layer (layer 3 here); vLLM raises the
    block size to 288 here (with the float32 SSM state the case names), so an
    attention page holds a Mamba state page."""
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        mlp_only_layers=[0, 1, 2],
        # Half the layers full attention: through linear attention alone the
        # first block barely moves the output of a long prompt.
        layer_types=[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
        ],
        max_position_embeddings=4096,
    )
    return _write(root / "tiny-qwen3-next", config, "bfloat16")


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llama": llama,
    "gemma3": gemma3,
    "gpt_oss": gpt_oss,
    "qwen3_next": qwen3_next,
}
