"""layer_mask: a block's (shard, layer) bits, the all-layers shortcut equal to
the general packing."""

from __future__ import annotations

import numpy as np

from pegaflow.cache.block_entry import layer_mask


def reference(rank: int, layers: np.ndarray, num_layers: int) -> int:
    return sum(1 << (rank * num_layers + int(layer)) for layer in layers)


def test_masks_equal_their_bits() -> None:
    rng = np.random.default_rng(2)
    for _ in range(200):
        num_layers = int(rng.integers(1, 130))
        rank = int(rng.integers(0, 8))
        if rng.random() < 0.4:
            layers = np.arange(num_layers)  # every layer: the shortcut
        else:
            k = int(rng.integers(0, num_layers + 1))
            layers = np.sort(rng.choice(num_layers, k, replace=False))
        assert layer_mask(rank, layers, num_layers) == reference(
            rank, layers, num_layers
        )
