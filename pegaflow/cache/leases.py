"""Leases pin the blocks a query hit until every worker of the instance loaded
them, the engine released them, or they expired."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import takewhile

import numpy as np

from pegaflow.common.errors import LeaseNotFound, Overloaded
from pegaflow.common.identity import UNKNOWN
from pegaflow.common.keys import BlockHash

from .block_entry import BlockEntry
from .block_store import BlockStore

DirectRead = Callable[..., Awaitable[np.ndarray]]


@dataclass(slots=True)
class Lease:
    id: int
    owner: str  # instance id that queried; only its workers load it
    namespace_id: int
    entries: list[BlockEntry]
    world_size: int
    expires: float
    user: int  # the instance's owner uid (UNKNOWN: a remote engine's)
    nbytes: int  # of the pool the entries pin
    loaded_by: set[int] = field(default_factory=set)
    # Blocks after the L1 entries that a lower tier reads straight into the
    # engine's blocks at its load (pegaflow.tiers.ssd_gpu_direct), and the
    # reader: (worker, hashes, block ids, deadline) -> landed. Nothing pinned.
    direct: list[BlockHash] = field(default_factory=list)
    read: DirectRead | None = None

    @property
    def blocks(self) -> int:
        return len(self.entries) + len(self.direct)


# What one instance may hold at once. The connector releases every lease it
# does not load, so an engine holds about one per request it schedules; a
# client that queries without ever loading or releasing would otherwise pin
# blocks (unevictable) and grow the table until the TTL, without bound.
MAX_LEASES_PER_INSTANCE = 1 << 16
MAX_LEASED_BLOCKS_PER_INSTANCE = 1 << 22


class TooManyLeases(Overloaded):
    pass


class LeaseTable:
    """max_leased_bytes: what the leases of all users' instances may pin at
    once, shared equally by the users holding leases (a user is an owner uid;
    all of unknown uid, remote engines, count as one). The blocks a user
    cached are its to lease, but leased they cannot be evicted: one user
    leasing all it holds, again before each lease expires, would leave no
    slot another user's saves could take; so would two users each leasing
    the whole bound. Queries past a user's part are answered the prefix that
    fits. A part shrinks as users come: leases taken before keep their
    blocks until they end (a load, or the TTL), and that user's queries
    lease nothing more until it is back within its part."""

    def __init__(
        self, store: BlockStore, ttl_s: float, max_leased_bytes: int | None = None
    ) -> None:
        self._store = store
        self.ttl_s = ttl_s
        self.max_leased_bytes = max_leased_bytes
        self._leases: dict[int, Lease] = {}
        self._held: dict[str, list[int]] = {}  # owner -> [leases, leased blocks]
        self._user_bytes: dict[int, int] = {}  # owner uid -> bytes its leases pin
        self.expired = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def room(self, user: int, block_bytes: int, wanted: int) -> int:
        """How many of `wanted` blocks of block_bytes (over all shards) the
        user's leases may pin now."""
        if self.max_leased_bytes is None or not wanted:
            return wanted
        held = self._user_bytes
        part = self.max_leased_bytes // (len(held) + (user not in held))
        free = part - held.get(user, 0)
        return min(wanted, max(0, free) // max(1, block_bytes))

    def create(
        self,
        owner: str,
        namespace_id: int,
        entries: list[BlockEntry],
        world_size: int,
        direct: list[BlockHash] | None = None,
        read: DirectRead | None = None,
        user: int = UNKNOWN,
        block_bytes: int = 0,
    ) -> Lease:
        """Past room(user, block_bytes, ...) too, the entries are leased: the
        caller cuts the answer to room first."""
        held = self._held.setdefault(owner, [0, 0])
        if (
            held[0] >= MAX_LEASES_PER_INSTANCE
            or held[1] + len(entries) > MAX_LEASED_BLOCKS_PER_INSTANCE
        ):
            raise TooManyLeases(
                f"instance_id: {owner!r} holds {held[0]} leases of {held[1]} "
                f"blocks (at most {MAX_LEASES_PER_INSTANCE} and "
                f"{MAX_LEASED_BLOCKS_PER_INSTANCE}); load or release them "
                "(ReleaseLease), or let them expire"
            )
        held[0] += 1
        held[1] += len(entries)
        nbytes = len(entries) * block_bytes
        if nbytes:  # a user holding no bytes takes no part of the bound
            self._user_bytes[user] = self._user_bytes.get(user, 0) + nbytes
        lease_id = secrets.randbits(63) | 1  # unguessable, never 0 ("no lease")
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) | 1
        lease = Lease(
            lease_id,
            owner,
            namespace_id,
            entries,
            world_size,
            time.monotonic() + self.ttl_s,
            user,
            nbytes,
            direct=direct or [],
            read=read,
        )
        self._leases[lease.id] = lease
        self._store.pin_lease(lease.id, entries)
        return lease

    def get(self, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(
                f"lease_id: {lease_id} is unknown, expired or already consumed"
            )
        return lease

    def consumed(self, lease: Lease, worker_rank: int) -> None:
        """A worker finished its load; the last one releases the pins."""
        lease.loaded_by.add(worker_rank)
        if len(lease.loaded_by) >= lease.world_size:
            self.release(lease.id)

    def release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound(
                f"lease_id: {lease_id} is unknown, expired or already consumed"
            )
        held = self._held[lease.owner]
        held[0] -= 1
        held[1] -= len(lease.entries)
        if not held[0]:
            del self._held[lease.owner]
        left = self._user_bytes.pop(lease.user, 0) - lease.nbytes
        if left:
            self._user_bytes[lease.user] = left
        self._store.unpin_lease(lease.id, lease.entries)

    def held_in(self, namespace_id: int) -> bool:
        """Whether a lease pins blocks of the namespace (a scan: asked only
        when a namespace might be freed)."""
        return any(le.namespace_id == namespace_id for le in self._leases.values())

    def release_owned_by(self, owner: str) -> int:
        owned = [lid for lid, lease in self._leases.items() if lease.owner == owner]
        for lid in owned:
            self.release(lid)
        return len(owned)

    def sweep(self, now: float | None = None) -> int:
        """Release the expired leases. They expire in the order they were
        made (one ttl_s, a monotonic clock): the first live one ends the look,
        not a pass over every lease each second (65,536 an instance)."""
        now = time.monotonic() if now is None else now
        leases = self._leases
        dead = list(takewhile(lambda lid: leases[lid].expires <= now, leases))
        for lid in dead:
            self.release(lid)
        self.expired += len(dead)
        return len(dead)
