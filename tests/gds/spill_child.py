"""A writer process for the crash test: spills blocks start.. forever in batches,
printing 'durable N' after each batch is flushed (blocks below N are written)."""

from __future__ import annotations

import sys
from pathlib import Path

from pegaflow.gds import SsdTier
from tests.gds.helpers import NS, SLOT_CRASH, addresses, block, config, key


def main() -> None:
    folder, start = Path(sys.argv[1]), int(sys.argv[2])
    tier = SsdTier(config(folder, capacity=64 << 20, queue_blocks=16))
    i = start
    while True:
        held = [block(j, 1, SLOT_CRASH) for j in range(i, i + 16)]
        for j, data in enumerate(held, start=i):
            tier.spill(NS, key(j), addresses(data), SLOT_CRASH)
        tier.flush()
        i += 16
        print(f"durable {i}", flush=True)


if __name__ == "__main__":
    main()
