"""A Load's items checked against their leases, and the one descriptor table
that copies every item's L1 blocks in one call (one kernel launch)."""

from __future__ import annotations

import dataclasses
from operator import attrgetter, itemgetter

import numpy as np

from pegaflow.cache.block_store import BlockEntry
from pegaflow.cache.instances import Worker
from pegaflow.cache.leases import Lease
from pegaflow.common.errors import CopyFailed, InvalidRequest
from pegaflow.common.geometry import Transfers, check_block_ids, check_distinct
from pegaflow.common.keys import BlockHash
from pegaflow.common.results import LoadBatchResult, LoadItemResult

_SLOTS = attrgetter("slots")


@dataclasses.dataclass(slots=True, eq=False)
class LoadItem:
    """One item of a Load: its leased L1 blocks into block_ids, then the
    blocks a tier reads straight in (Lease.direct) into direct_ids."""

    lease: Lease
    entries: list[BlockEntry]
    block_ids: np.ndarray
    direct: list[BlockHash]
    direct_ids: np.ndarray


def plan_item(
    worker: Worker, lease: Lease, offset: int, block_ids: np.ndarray, field: str
) -> LoadItem:
    """field: the item's prefix in error messages ("items[3]." or "")."""
    if lease.owner != worker.instance_id:
        raise InvalidRequest(
            f"{field}lease_id: lease belongs to {lease.owner!r}, "
            f"not {worker.instance_id!r}"
        )
    if lease.namespace_id != worker.namespace.id:
        # The instance re-registered with another geometry since the query:
        # the leased slots are not laid out as this worker's blocks.
        raise InvalidRequest(
            f"{field}lease_id: leased under another registration of "
            f"{worker.instance_id!r}; query again"
        )
    end = offset + len(block_ids)
    if end > lease.blocks:
        raise InvalidRequest(
            f"{field}block_ids: lease_offset {offset} + {len(block_ids)} blocks "
            f"exceeds the {lease.blocks} leased blocks"
        )
    check_block_ids(block_ids, worker.geometry.num_blocks, f"{field}block_ids")
    in_l1 = len(lease.entries)
    cut = max(0, min(len(block_ids), in_l1 - offset))
    return LoadItem(
        lease,
        lease.entries[offset : offset + cut],
        block_ids[:cut],
        lease.direct[max(0, offset - in_l1) : max(0, end - in_l1)],
        block_ids[cut:],
    )


def l1_transfers(
    worker: Worker, live: list[LoadItem], entries: list[BlockEntry]
) -> Transfers:
    """One descriptor table for every item's L1 blocks; every engine block
    of the Load (direct ones too) distinct."""
    if not live:
        return worker.geometry.slots_to_engine(*[np.zeros(0, np.uint64)] * 2)
    ids = np.concatenate([p.block_ids for p in live])
    direct = [p.direct_ids for p in live if p.direct]
    check_distinct(np.concatenate([ids, *direct]) if direct else ids, "block_ids")
    # Each block's slot of the worker's shard (0 for MLA), in one
    # C-level pass: no [blocks, shards] array of Python lists first.
    shard = map(itemgetter(worker.shard), map(_SLOTS, entries))
    slots = np.fromiter(shard, np.uint64, len(entries))
    return worker.geometry.slots_to_engine(slots, ids)


def item_results(
    plans: list[LoadItem | None],
    errors: list[str],
    landed: dict[int, int],
    batch: bool,
    slot_bytes: int,
    in_flight: bool = False,
) -> LoadBatchResult:
    """A Load's answer: per item what loaded, or why not (its lease gone; its
    tier blocks that did not land: `landed` by id() of each item). A single
    lease's load raises CopyFailed for the latter."""
    results = []
    for i, (p, err) in enumerate(zip(plans, errors, strict=True)):
        if p is None:
            results.append(LoadItemResult(0, 0, err))
            continue
        direct = landed.get(id(p), 0)
        if direct < len(p.direct):
            err = (
                f"{f'items[{i}].' if batch else ''}block_ids: "
                f"{len(p.direct) - direct} of the blocks read from the SSD did "
                "not load (dropped from it meanwhile, or damaged); the engine "
                "blocks may hold anything: recompute them"
            )
            if not batch:
                raise CopyFailed(err)
        got = len(p.entries) + direct
        results.append(LoadItemResult(got, got * slot_bytes, err))
    loaded = sum(r.loaded for r in results)
    total = sum(r.bytes for r in results)
    return LoadBatchResult(loaded, total, tuple(results), in_flight)
