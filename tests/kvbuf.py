"""KV memory owned by the test process itself, registered with a server that runs
in another process: bytes really cross process boundaries."""

from __future__ import annotations

import os
import secrets

import numpy as np

from pegaflow.client.kv_layouts import KVMemory, describe, vllm_layer_views
from pegaflow.client.pegaflow_client import PegaflowClient, Registration


class LocalKV:
    """vLLM 0.33-style KV: one int8 buffer, per-layer [blocks, page] views."""

    def __init__(
        self,
        layers: int = 4,
        blocks: int = 64,
        page: int = 4096,
        seed: int = 0,
        block_first: bool = False,
    ) -> None:
        self.layers, self.blocks, self.page = layers, blocks, page
        rng = np.random.default_rng(seed)
        self.buf = rng.integers(0, 256, layers * blocks * page, dtype=np.uint8)
        self.views = vllm_layer_views(self.buf, layers, blocks, (page,), block_first)
        self.mem: KVMemory = describe(self.views)

    def block(self, b: int) -> np.ndarray:
        """All layers of block b, in slot order."""
        return np.concatenate([v[b] for v in self.views])

    def randomize(self, ids: list[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for v in self.views:
            v[ids] = rng.integers(0, 256, (len(ids), self.page), dtype=np.uint8)

    def register(
        self,
        client: PegaflowClient,
        instance: str,
        namespace: str,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> Registration:
        return client.register_host(
            instance,
            namespace,
            os.getpid(),
            self.mem.regions,
            self.mem.layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )


def hashes(n: int, prefix: bytes = b"") -> list[bytes]:
    """Random 32-byte block hashes (vLLM's sha256 chain looks just as random)."""
    return [prefix + secrets.token_bytes(32 - len(prefix)) for _ in range(n)]
