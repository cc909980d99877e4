"""The FIFO ring and the journal replay, against a byte-ownership model."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pegaflow.gds import journal
from pegaflow.gds.format import ALIGN
from pegaflow.gds.ring import CHUNK, Index, Record, Records, Ring, State, walk

NS = b"n" * 16
PAGES = 64


def _fresh() -> tuple[Ring, Index]:
    return Ring(0, ALIGN, ALIGN * (PAGES + 1)), Index()


def _claim(ring: Ring, index: Index, seq: int, pages: int) -> Record | None:
    length = pages * ALIGN
    offset = ring.place(length)
    if offset is None:
        return None
    rec = Record(0, offset, length, seq, NS, seq.to_bytes(4, "little"))
    rec.state = State.LIVE
    for victim in ring.claim(offset, length, rec):
        index.remove(victim)
    index.put(rec)
    return rec


def _replay(data: bytes) -> tuple[Ring, Index]:
    ring, index = _fresh()
    entries = np.frombuffer(data, journal._DTYPE)
    journal.replay(entries, [ring], index, progress=False)
    return ring, index


def _live(index: Index) -> list[int]:
    return sorted(r.seq for t in index.tables.values() for r in t.values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=120))
def test_ring_never_indexes_overwritten_space(sizes: list[int]) -> None:
    ring, index = _fresh()
    owner = np.zeros(PAGES + 1, np.int64)  # page -> seq that wrote it last
    log: list[bytes] = []
    placed: list[int] = []
    for seq, pages in enumerate(sizes, start=1):
        rec = _claim(ring, index, seq, pages)
        if rec is None:
            continue
        owner[rec.offset // ALIGN : (rec.offset + rec.length) // ALIGN] = seq
        placed.append(seq)
        log += [journal.entry(journal.Kind.RESERVE, rec)]
        log += [journal.entry(journal.Kind.COMMIT, rec)]
        live = _live(index)
        for s in live:  # every indexed record still owns all of its pages
            r = index.get(NS, s.to_bytes(4, "little"))
            assert r is not None
            assert (
                owner[r.offset // ALIGN : (r.offset + r.length) // ALIGN] == s
            ).all()
        assert live == placed[len(placed) - len(live) :]  # FIFO: the newest survive
        assert sum(r.length for t in index.tables.values() for r in t.values()) <= (
            PAGES * ALIGN
        )
    # the journal and a snapshot both rebuild the same ring
    for data in (b"".join(log), b"".join(journal.snapshot([ring]))):
        again, again_index = _replay(data)
        assert _live(again_index) == _live(index)
        assert again.head == ring.head
    # and keep evicting alike afterwards
    again, again_index = _replay(b"".join(log))
    for seq in range(1000, 1010):
        _claim(ring, index, seq, 7)
        _claim(again, again_index, seq, 7)
        assert _live(again_index) == _live(index)


def test_uncommitted_reserve_is_dropped_by_replay() -> None:
    ring, index = _fresh()
    a = _claim(ring, index, 1, 4)
    b = Record(0, ring.head, 4 * ALIGN, 2, NS, b"torn")
    assert a is not None
    data = [
        journal.entry(journal.Kind.RESERVE, a),
        journal.entry(journal.Kind.COMMIT, a),
        journal.entry(journal.Kind.RESERVE, b),
    ]
    again, again_index = _replay(b"".join(data))
    assert _live(again_index) == [1]
    assert [r.state for r in again.records] == [State.LIVE, State.DEAD]


def test_busy_records_are_reported_as_victims() -> None:
    ring, index = _fresh()
    recs = [_claim(ring, index, s, 16) for s in range(1, 5)]  # ring full
    assert all(recs)
    recs[0].readers = 1  # type: ignore[union-attr]
    offset = ring.place(16 * ALIGN)
    assert offset == ALIGN
    victims = ring.victims(offset, 16 * ALIGN)
    assert victims == [recs[0]] and victims[0].busy


def test_a_records_view_is_cheap_and_outlives_later_changes() -> None:
    """The journal's snapshot reads a view of each ring's records outside
    the store's lock: taken in O(chunks), and what it names stays as it was
    whatever the queue does after (drops from the front, appends)."""
    recs = Records()
    made = [Record(0, i * ALIGN, ALIGN, i) for i in range(5 * CHUNK + 7)]
    recs.extend(made[:100])
    recs.drop_front(3)
    for rec in made[100 : 3 * CHUNK]:
        recs.append(rec)
    recs.drop_front(CHUNK)  # past the first chunk's end
    view = recs.view()
    assert len(view) <= 3 * CHUNK // CHUNK + 1
    then = list(recs)
    assert then == made[3 + CHUNK : 3 * CHUNK]
    assert (recs[0], recs[-1], len(recs)) == (then[0], then[-1], len(then))
    recs.extend(made[3 * CHUNK :])
    recs.drop_front(2 * CHUNK)
    assert list(walk(view)) == then  # unchanged by what came after
    assert list(recs) == made[3 + 3 * CHUNK :]
    while recs:
        recs.popleft()
    recs.append(made[0])
    assert list(recs) == [made[0]] and list(walk(view)) == then
