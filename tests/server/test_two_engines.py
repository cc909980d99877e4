"""Engine A (own process, torch CPU tensors) saves and is SIGKILLed; engine B (own
process) hits, loads into other block ids; every byte equal (sha256 per block)."""

from __future__ import annotations

import secrets

import pytest

SHAPES = dict(layers=4, blocks=128, heads=2, block_size=16, head=64, seed=7)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC", "kv_first"])
def test_save_kill_hit_load(server, engines, layout: str) -> None:
    a, b = engines(), engines()
    a.call("init", layout=layout, **SHAPES)
    b.call("init", layout=layout, **{**SHAPES, "seed": 99})
    a.call("register", addr=server.addr, instance="engine-a", namespace=f"ns-{layout}")
    hashes = [secrets.token_hex(32) for _ in range(100)]
    src = list(range(100))
    assert a.call("save", block_ids=src, hashes=hashes)["stored"] == 100
    expected = a.call("digest", block_ids=src)["digests"]
    a.kill()

    b.call("register", addr=server.addr, instance="engine-b", namespace=f"ns-{layout}")
    dst = [127 - i for i in range(100)]  # other ids, reversed order
    before = b.call("digest", block_ids=dst)["digests"]
    assert before != expected
    hit = b.call("query", hashes=hashes + [secrets.token_hex(32)])
    assert hit["num_blocks"] == 100
    loaded = b.call("load", lease_id=hit["lease_id"], block_ids=dst)
    assert loaded["loaded"] == 100
    assert b.call("digest", block_ids=dst)["digests"] == expected
    assert server.metric("pegaflow_registered_workers") == 1  # A's session closed
