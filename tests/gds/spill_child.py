"""A writer process for the crash test: spills blocks start.. forever in batches,
printing 'durable N' after each batch is flushed (blocks below N are written).
A third argument "aligned": from page-aligned memory, so the writers write the
slots in place (gather writes) instead of staging them."""

from __future__ import annotations

import sys
from pathlib import Path

from pegaflow.gds import SsdTier
from tests.gds.helpers import (
    NS,
    SLOT_CRASH,
    SLOT_CRASH_ALIGNED,
    addresses,
    block,
    config,
    key,
    page_aligned,
)


def main() -> None:
    folder, start = Path(sys.argv[1]), int(sys.argv[2])
    aligned = sys.argv[3:] == ["aligned"]
    slot = SLOT_CRASH_ALIGNED if aligned else SLOT_CRASH
    tier = SsdTier(config(folder, capacity=64 << 20, queue_blocks=16))
    i = start
    while True:
        held = [block(j, 1, slot) for j in range(i, i + 16)]
        if aligned:
            held = [page_aligned(data) for data in held]
        for j, data in enumerate(held, start=i):
            tier.spill(NS, key(j), addresses(data), slot)
        tier.flush()
        i += 16
        print(f"durable {i}", flush=True)


if __name__ == "__main__":
    main()
