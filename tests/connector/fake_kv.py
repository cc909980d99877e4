"""The fake model's KV: a token position's fake KV is a function of
tokens[0..p] only (a rolling hash), as real attention KV is, so two engines
that compute the same prefix write the same bytes, and a page can be checked
against that function (engine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per block, in every group
MASK = (1 << 61) - 1


@dataclass
class Seq:
    tokens: list[int]
    rolling: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)  # positions this engine ran

    def value(self, pos: int) -> int:
        while len(self.rolling) <= pos:
            prev = self.rolling[-1] if self.rolling else 7
            self.rolling.append(
                (prev * 1000003 + self.tokens[len(self.rolling)]) & MASK
            )
        return self.rolling[pos]


def pages(view: torch.Tensor) -> torch.Tensor:
    """A layer's view as int16 [blocks, heads, block_size, width]: vLLM 0.33
    hands [blocks, heads, block_size, content] (MLA: one head); MLA's kernel
    layout (and older vLLM's) is [blocks, block_size, head_dim], one head."""
    kv = view.view(torch.int16)
    return kv.unsqueeze(1) if kv.dim() == 3 else kv


def what_is_there(got: torch.Tensor, seq: Seq, block: int, layers: int) -> str:
    """For a wrong page: whether it holds nothing, or the fake KV of another
    layer or block of the same request (a load landing in the wrong place)."""
    if not got.any():
        return " (all zero: never written)"
    heads, width = got.shape[1], got.shape[2]
    for k in range(block + 2):
        pos = range(k * BLOCK, (k + 1) * BLOCK)
        if pos[-1] >= len(seq.tokens):
            break
        values = torch.tensor([seq.value(p) for p in pos], dtype=torch.int64)
        for layer in range(layers):
            if torch.equal(got, fake_kv_batch(values, layer, heads, width)):
                return f" (holds block {k} layer {layer})"
    return " (holds none of this request's blocks)"


def fake_kv_batch(
    values: torch.Tensor, layer: int, heads: int, width: int
) -> torch.Tensor:
    """fake KV of several tokens in one layer: [tokens, heads, width] int16."""
    base = torch.arange(heads * width, dtype=torch.int64).reshape(1, heads, width)
    v = values.reshape(-1, 1, 1)
    return ((base * (v % 9973 + 1) + v + layer * 7919) % 65521 - 32760).to(torch.int16)


def fake_state(value: int, layer: int, width: int) -> torch.Tensor:
    """A Mamba layer's fake state after the token whose rolling hash is value."""
    return fake_kv_batch(torch.tensor([value]), layer, 1, width).reshape(width)
