"""A metaserver that answers late is no miss (issue 30 #15): the query answers
`loading` while the metaserver's answer is awaited in the background, and the
engine's next polls get the whole prefix, every byte checked."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.remote.conftest import SHAPE_BLOCK_BYTES, Cluster, block_hashes, indexed

pytestmark = pytest.mark.timeout(240)

STOPPED_S = 1.0  # far past --remote-query-timeout (50 ms) and short of staleness


def test_late_metaserver_answer_is_loading_not_a_miss(cluster: Cluster) -> None:
    """Scenario: node 0 holds 16 blocks, indexed. The metaserver is stopped
    (SIGSTOP: a host too busy to run it) while node 1's engine queries them,
    and continued a second later. Before the fix the query was a miss after
    50 ms (failures {'metaserver': 16}) and remembered as one; now it answers
    `loading`, the background query gets the plan once the metaserver runs,
    and the engine's polls end with all 16 blocks, equal byte for byte."""
    owner = cluster.engine(0, "slow-a", 21)
    ids = list(range(3, 19))
    hashes = block_hashes("slow", 16)
    assert owner.call("save", block_ids=ids, hashes=hashes)["stored"] == 16
    digests = owner.call("digest", block_ids=ids)["digests"]
    reader = cluster.engine(1, "slow-b", 22)
    indexed(cluster, 0, hashes, SHAPE_BLOCK_BYTES)
    was = cluster.remote(1)["failed_blocks"]["metaserver"]
    meta = cluster.meta.proc
    meta.send_signal(signal.SIGSTOP)
    result: dict = {}
    try:
        started = time.monotonic()
        thread = threading.Thread(
            target=lambda: result.update(reader.call("query", hashes=hashes, wait_s=30))
        )
        thread.start()
        # The metaserver stays stopped for the scenario's second, or until
        # the query gave up on it (the old behaviour).
        thread.join(STOPPED_S)
        stalled = time.monotonic() - started
    finally:
        meta.send_signal(signal.SIGCONT)
    thread.join(40)
    assert not thread.is_alive(), "the query hung"
    assert stalled >= STOPPED_S, (
        f"the query ended while the metaserver was stopped: {result}"
    )
    assert result["num_blocks"] == 16, result
    assert result["polls"] > 0, result  # it answered `loading` meanwhile
    dst = list(range(40, 56))
    loaded = reader.call("load", lease_id=result["lease_id"], block_ids=dst)
    assert loaded["loaded"] == 16
    assert reader.call("digest", block_ids=dst)["digests"] == digests
    assert cluster.remote(1)["failed_blocks"]["metaserver"] == was
