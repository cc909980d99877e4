"""The leases of all users pin at most --max-leased-share of the pool (0.9 by
default, half here), each user holding leases an equal part of it: a query
past its part is answered the prefix that fits, and the rest of the pool stays
evictable, so no user's engines (nor two users') can lock everyone else's
saves out by leasing all they cached, again before each lease expires."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes
from tests.procs import ROOT, ServerProc, _env

PAGE = 4096
LAYERS = 4
BLOCK_BYTES = LAYERS * PAGE
POOL = 4 << 20


def test_a_users_leases_leave_the_rest_of_the_pool_to_saves(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Scenario: an engine filled the pool and leased every block it held
    (queries it never loaded, asked again before the leases expired); no other
    engine's save found a block to evict, all were refused. Now the leases
    stop at half the pool, the saves evict the other half, and the leased
    blocks load intact."""
    server = server_factory("--pool-size", "4mb", "--max-leased-share", "0.5")
    cap = POOL // 2 // BLOCK_BYTES
    blocks = cap * 3 // 2  # all fit, beside the slabs' own bytes
    kv = LocalKV(layers=LAYERS, blocks=blocks + cap, page=PAGE, seed=5)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "e", "model")
        held = hashes(blocks)
        assert client.save("e", list(range(blocks)), held).stored == blocks
        first = client.query("e", held)
        assert first.num_blocks == cap
        assert client.query("e", held).num_blocks == 0  # its leases hold the share
        assert (
            server.metric("pegaflow_lease_capped_blocks_total") == blocks - cap + blocks
        )
        before = np.stack([kv.block(b) for b in range(cap)])

        new = hashes(cap)
        kv.randomize(list(range(cap)), seed=6)
        saved = client.save("e", list(range(cap)), new).stored
        assert saved >= blocks - cap  # every block not leased made room
        assert client.query("e", new).num_blocks == 0  # stored, but no room to lease

        into = list(range(blocks - 1, blocks - 1 - cap, -1))
        assert client.load("e", first.lease_id, into).loaded == cap
        got = np.stack([kv.block(b) for b in into])
        assert np.array_equal(got, before)  # every leased byte, in the lease's order
        # Loaded, the lease is gone and its share is free again.
        assert client.query("e", new).num_blocks == saved


NOBODY = 65534


def _as_nobody(setup: str, code: str) -> subprocess.CompletedProcess:
    """`setup` run as root, then `code` as NOBODY: everything it imports or
    builds comes first (the checkout may be unreadable for that uid: a 0700
    temp dir in CI), as does making the process dumpable again, as one that
    user started would be (the kernel marks one that changed its uid not)."""
    drop = (
        f"os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
        "import ctypes; ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE\n"
    )
    return subprocess.run(
        [sys.executable, "-c", "import os\n" + setup + drop + code],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as uid 65534")
def test_two_users_leasing_at_once_share_the_bound(
    server_factory: Callable[..., ServerProc],
) -> None:
    """Scenario: two users' engines each leased the whole share of the pool,
    and between them all of it: no save found a block to evict. Now each
    user holding leases gets half the share: the second user's query is
    answered its half, and the first user's next query nothing (its leases,
    taken alone, keep their blocks until they end)."""
    server = server_factory(
        "--pool-size", "4mb", "--max-leased-share", "0.5", "--allow-tcp-host-engines"
    )
    part = POOL // 2 // 2 // BLOCK_BYTES
    blocks = part * 3 // 2  # two users' blocks fit the pool, beside its slabs
    kv = LocalKV(layers=LAYERS, blocks=blocks, page=PAGE, seed=7)
    with PegaflowClient(server.addr, timeout_s=10) as client:
        kv.register(client, "root-engine", "model")
        mine = hashes(blocks)
        assert client.save("root-engine", list(range(blocks)), mine).stored == blocks
        assert client.query("root-engine", mine).num_blocks == blocks  # alone
        setup = (
            "import grpc._channel, grpc._interceptor, grpc._utilities\n"
            "from pegaflow.client.pegaflow_client import PegaflowClient\n"
            "from tests.kvbuf import LocalKV, hashes\n"
            f"kv = LocalKV(layers={LAYERS}, blocks={blocks}, page={PAGE}, seed=8)\n"
            f"h = hashes({blocks}, b'n')\n"
            f"c = PegaflowClient({server.addr!r}, timeout_s=10)\n"
        )
        out = _as_nobody(  # over gRPC: the server's socket is root's only
            setup,
            "kv.register(c, 'nobody-engine', 'model')\n"
            f"print(c.save('nobody-engine', list(range({blocks})), h).stored,\n"
            "      c.query('nobody-engine', h).num_blocks)\n",
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(blocks), str(part)]
        assert client.query("root-engine", mine).num_blocks == 0


@pytest.mark.parametrize("value", ["0", "1.5", "nan", "half"])
def test_a_bad_share_is_refused_naming_the_flag(value: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pegaflow.cli", "--no-http", "--addr",
         "127.0.0.1:0", "--max-leased-share", value],
        capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "argument --max-leased-share:" in res.stderr
