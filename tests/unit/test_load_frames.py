"""Load frames: the one-item fast paths of decode_load and load_reply give
what the general (structured-array) path gives, and refuse what it refuses."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from pegaflow.common import socket_frames as frames
from pegaflow.common.errors import InvalidRequest


@dataclass
class Item:
    loaded: int
    bytes: int
    error: str


def body_of(items, batch: bool) -> bytes:
    frame = frames.encode_load("inst-é", 3, items, batch, layer_seq=7,
                               deadline_ns=11, token=b"t" * 16)  # fmt: skip
    assert frame is not None
    return frame[4:]  # without the length prefix


@pytest.mark.parametrize("batch", [False, True])
def test_one_item_decodes_as_the_general_path(batch: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 1 << 32, int(rng.integers(0, 50)))
        lease, offset = int(rng.integers(1, 1 << 63)), int(rng.integers(0, 1 << 32))
        body = body_of([(lease, offset, ids)], batch)
        got = frames.decode_load(body)
        table_at = frames.LOAD_HEADER.size + len("inst-é".encode())
        ids_at = table_at + frames.LOAD_ITEM.itemsize
        ((g_lease, g_off, g_ids),) = got[2]
        ((w_lease, w_off, w_ids),) = frames._load_items(body, 1, table_at, ids_at)
        assert (g_lease, g_off) == (w_lease, w_off) == (lease, offset)
        assert g_ids.dtype == w_ids.dtype == np.int64
        np.testing.assert_array_equal(g_ids, w_ids)
        np.testing.assert_array_equal(g_ids, ids)
        assert got[0] == "inst-é" and got[1] == 3 and got[3] is batch


def test_one_item_with_a_wrong_length_is_refused() -> None:
    body = body_of([(5, 0, np.arange(4))], False)
    for cut in (body[:-1], body + b"\0\0\0\0"):
        with pytest.raises(InvalidRequest, match="header promises"):
            frames.decode_load(cut)


def test_one_item_reply_is_the_tables_bytes() -> None:
    for item in (Item(3, 6 << 20, ""), Item(0, 0, "lease 9: expired ✗")):
        fast = frames.load_reply(item.loaded, item.bytes, [item])
        general = frames.load_reply(item.loaded, item.bytes, [item, item])
        head = frames.LOAD_REPLY.size
        row = frames.LOAD_ITEM_REPLY.itemsize
        error = item.error.encode()
        assert fast[head:] == general[head : head + row] + error
        assert frames.parse_load_reply(fast) == (
            item.loaded, item.bytes, [(item.loaded, item.bytes, item.error)], False
        )  # fmt: skip


def test_one_item_encodes_as_the_general_path() -> None:
    """encode_load's one-item struct gives the structured array's bytes, and
    refuses (None: gRPC carries it and names the field) what that refuses."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, 1 << 32, int(rng.integers(0, 50)))
        lease, offset = int(rng.integers(1, 1 << 63)), int(rng.integers(0, 1 << 32))
        body = body_of([(lease, offset, ids)], True)
        table_at = frames.LOAD_HEADER.size + len("inst-é".encode())
        want = np.zeros(1, frames.LOAD_ITEM)
        want["lease_id"], want["lease_offset"], want["count"] = lease, offset, len(ids)
        end = table_at + frames.LOAD_ITEM.itemsize
        assert body[table_at:end] == want.tobytes()
        assert body[end:] == ids.astype("<u4").tobytes()
    for bad in [(-1, 0, [1]), (1 << 64, 0, [1]), (1, 1 << 32, [1]), (1, -1, [1])]:
        assert frames.encode_load("i", 0, [bad], True) is None
        assert frames.encode_load("i", 0, [bad, (2, 0, [3])], True) is None


def test_one_item_reply_size_is_the_general_one() -> None:
    for error in ("", "lease 9: expired ✗"):
        item = Item(0 if error else 3, 0 if error else 6 << 20, error)
        for items in ([item], [item, item]):
            reply = bytearray(frames.load_reply(item.loaded, item.bytes, items))
            assert frames.load_reply_size(reply) == len(reply)
            head = frames.LOAD_REPLY.size + len(items) * frames.LOAD_ITEM_REPLY.itemsize
            assert frames.load_reply_size(reply[: head - 1]) == head  # ask for more


def test_a_load_naming_more_items_than_any_step_has_is_refused_on_its_header() -> None:
    """An 8 MiB frame can name ~520K empty items: each was built as a Python
    object on the event loop (~0.3 s a frame) before the instance, the token
    or the block cap were checked. The count is refused from the header."""
    from pegaflow.common.request_limits import MAX_LOAD_ITEMS, RequestCaps

    empty = np.zeros(0, np.int64)
    most = body_of([(1, 0, empty)] * MAX_LOAD_ITEMS, batch=True)
    assert len(frames.decode_load(most)[2]) == MAX_LOAD_ITEMS
    over = body_of([(1, 0, empty)] * (MAX_LOAD_ITEMS + 1), batch=True)
    with pytest.raises(InvalidRequest, match=f"items: {MAX_LOAD_ITEMS + 1} in one"):
        frames.decode_load(over)
    # the same bound for gRPC's Load, whose items protobuf has already parsed
    caps = RequestCaps(1 << 30, 1 << 24, 1 << 20)
    with pytest.raises(InvalidRequest, match="items: "):
        caps.check_load((4096, 0), [(1, 0, [])] * (MAX_LOAD_ITEMS + 1), True)


@pytest.mark.parametrize(("n", "batch"), [(1, False), (1, True), (7, True)])
def test_a_load_reply_never_exceeds_what_its_frame_is_charged(
    n: int, batch: bool
) -> None:
    """The socket's backlog budget charges a queued load load_reply_bound; an
    item's error line was as long as the server made it, so a reply could
    outgrow that charge. Lines are cut to LOAD_ITEM_ERROR_MAX now."""
    body = body_of([(i + 1, 0, np.arange(i + 1)) for i in range(n)], batch)
    bound = frames.load_reply_bound(body)
    for error in ("", "é" * 1000, "x" * frames.LOAD_ITEM_ERROR_MAX):
        if not batch and error:
            continue  # a single lease's failure is an error reply
        reply = frames.load_reply(0, 0, [Item(0, 0, error)] * n)
        assert len(reply) <= bound, (error[:5], len(reply), bound)
        assert frames.parse_load_reply(reply)[2][0][2] in error  # a cut, whole or not
    assert len(reply) == bound  # the longest line fits exactly
    # Refused before any item is read: an error answers it, charged apart.
    table_end = frames.LOAD_HEADER.size + len("inst-é".encode()) + 16 * n
    assert frames.load_reply_bound(body[: table_end - 1]) == 0
    assert frames.load_reply_bound(bytes([frames.SAVE]) + body[1:]) == 0


_SOME_LEASE = 987654321


def _gone_message() -> str:
    """The lease table's own LeaseNotFound message, for _SOME_LEASE."""
    from pegaflow.cache.leases import LeaseTable
    from pegaflow.common.errors import LeaseNotFound

    with pytest.raises(LeaseNotFound) as exc:
        LeaseTable(None, 1.0).get(_SOME_LEASE)  # type: ignore[arg-type]
    return str(exc.value)


def _ssd_lost(i: int, count: int) -> str:
    """pegaflow.server.engine's line for items[i] whose `count` blocks read
    from the SSD did not load: the longest line an item with blocks gets."""
    return (
        f"items[{i}].block_ids: {count} of the blocks read from the SSD did not "
        "load (dropped from it meanwhile, or damaged); the engine blocks may hold "
        "anything: recompute them"
    )


def test_the_reply_bound_is_tight_over_random_loads() -> None:
    """Scenario: random loads (1 to 16,384 items, some naming no blocks,
    random lease ids up to the longest) answered with random error lines:
    none, a gone lease's, and lines longer than LOAD_ITEM_ERROR_MAX. A reply
    never outgrows load_reply_bound, and the bound is within 1.25x of the
    longest reply the server can write for that load (each item's lease gone,
    or its blocks lost from the SSD). It was 272 B an item, 2.8x a gone
    lease's line."""
    message = _gone_message()

    def gone(i: int, lease: int) -> str:  # the engine's line for items[i]
        return f"items[{i}]." + message.replace(str(_SOME_LEASE), str(lease))

    rng = random.Random(17)
    worst_ratio = 0.0
    for round_ in range(120):
        batch = round_ % 4 != 0
        n = rng.choice([1, 2, rng.randint(3, 64)]) if batch else 1
        if round_ in (5, 6):
            n = rng.randint(10000, frames.MAX_LOAD_ITEMS)
        leases = [
            rng.choice([rng.randint(1, 999), rng.getrandbits(63) | 1, 2**64 - 1])
            for _ in range(n)
        ]
        counts = [rng.choice([0, 0, 1, rng.randint(2, 40)]) for _ in range(n)]
        pairs = list(zip(leases, counts, strict=True))
        items = [(lease, 0, np.arange(k)) for lease, k in pairs]
        bound = frames.load_reply_bound(body_of(items, batch))
        # The longest reply the server can write for it: each item failing
        # with the longest line it can get (a single lease's load: none).
        worst = [
            Item(0, 0, _ssd_lost(i, 2**32 - 1) if k else gone(i, 2**64 - 1))
            for i, k in enumerate(counts)
        ]
        most = len(frames.load_reply(0, 0, worst if batch else [Item(0, 0, "")]))
        assert most <= bound, (n, most, bound)
        worst_ratio = max(worst_ratio, bound / most)
        for _ in range(3 if batch else 0):  # random answers, long lines cut
            answer = []
            for i, (lease, k) in enumerate(pairs):
                kind = rng.randrange(4 if k else 2)
                line = ("", gone(i, lease), "é" * 500, "x" * 1000)[kind]
                answer.append(Item(0, 0, line))
            assert len(frames.load_reply(0, 0, answer)) <= bound
    assert worst_ratio <= 1.25, worst_ratio
    longest = gone(frames.MAX_LOAD_ITEMS - 1, 2**64 - 1)
    assert len(longest) == frames.LEASE_GONE_LINE_MAX
