"""TP=2 through the connector's worker half in two processes (one per rank), on
the CPU or a GPU, against a real server: the scenario the CPU test and the H200
test share. Needs no vLLM (the GPU machine has none)."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator

from pegaflow.client.pegaflow_client import PegaflowClient
from tests.procs import ROOT, ServerProc, _env, _readline

TP = 2
BLOCKS = 64
N = 24  # blocks engine A saves, two requests of 12
SRC = list(range(N))
DST = list(range(BLOCKS - 1, BLOCKS - 1 - N, -1))  # other ids, reversed
PART = list(range(N, N + 8))  # a second, sync load of A's first 8 blocks
GONE = list(range(N + 8, N + 12))  # a request whose lease is gone by the load


class RankProc:
    """tests/connector/rank_proc.py in its own process."""

    def __init__(self) -> None:
        script = ROOT / "tests" / "connector" / "rank_proc.py"
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_env(),
            cwd=ROOT,
        )

    def send(self, op: str, **kwargs: object) -> None:
        self.proc.stdin.write((json.dumps({"op": op, **kwargs}) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, op: str, timeout: float = 90.0) -> dict:
        line = _readline(self.proc, timeout)
        if not line:
            raise RuntimeError(f"rank gave no answer to {op} (rc={self.proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{op}: {answer['error']}: {answer['message']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError, OSError):
                self.send("exit")
                self.reply("exit", timeout=30)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def all_ranks(ranks: list[RankProc], op: str, **kwargs: object) -> list[dict]:
    """The same command to every rank at once (ranks run in parallel, as TP
    workers do); per-rank keyword values come as {"per_rank": [...]}."""
    for r, proc in enumerate(ranks):
        proc.send(op, **{k: _pick(v, r) for k, v in kwargs.items()})
    return [proc.reply(op) for proc in ranks]


def _pick(value: object, rank: int) -> object:
    if isinstance(value, dict) and "per_rank" in value:
        return value["per_rank"][rank]
    return value


@contextlib.contextmanager
def rank_procs() -> Iterator[list[RankProc]]:
    procs = [RankProc() for _ in range(TP)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.close()


def tp2_round_trip(
    server: ServerProc,
    ranks: list[RankProc],
    mla: bool,
    device: str,
    tag: str,
    **shape: object,
) -> None:
    """Engine A (TP=2) saves two requests' blocks in one step; engine B (the same
    two processes, re-registered with fresh zeroed KV) loads three requests in
    one step: an async load of all N blocks, a sync load of 8, and one whose
    lease was released. Every byte checked; MLA stored once."""
    metric: Callable[..., float] = server.metric
    hashes = [secrets.token_bytes(32) for _ in range(N)]
    init = dict(addr=server.addr, tp_size=TP, mla=mla, device=device, **shape)
    a = all_ranks(
        ranks, "init", instance=f"a-{tag}", tp_rank={"per_rank": [0, 1]}, **init
    )
    assert all(r["registered"] for r in a) and a[0]["namespace"] == a[1]["namespace"]
    assert all(r["replicated"] is mla for r in a)
    slot = a[0]["slot_bytes"]
    used_before = metric("pegaflow_pool_used_bytes")
    # MLA: every rank holds the same latent KV; otherwise each its own heads.
    seeds = [11, 11] if mla else [11, 12]
    all_ranks(ranks, "write", block_ids=SRC, seed={"per_rank": seeds})
    saves = [
        {
            "req_id": f"w{i}",
            "block_ids": SRC[i::2],
            "hashes": [h.hex() for h in hashes[i::2]],
        }
        for i in range(2)
    ]
    done = all_ranks(ranks, "step", loads=[], saves=saves)
    for r in done:
        assert not r["pending"] and r["saves_done"] == {"w0": 1, "w1": 1}
    stored = [r["stats"].get("save_blocks", 0) for r in done]
    # Stored once: the ranks' stripes partition the blocks (N/2 each).
    assert stored == ([N // 2, N // 2] if mla else [N, N])
    used = metric("pegaflow_pool_used_bytes") - used_before
    assert used == N * slot * (1 if mla else TP)
    want = all_ranks(ranks, "digest", block_ids=SRC)
    if mla:
        assert want[0] == want[1]

    # Engine B: other instance, same namespace, zeroed KV.
    b = all_ranks(
        ranks, "init", instance=f"b-{tag}", tp_rank={"per_rank": [0, 1]}, **init
    )
    assert b[0]["namespace"] == a[0]["namespace"]
    untouched = all_ranks(ranks, "digest", block_ids=GONE)
    with PegaflowClient(server.addr) as scheduler:
        full = scheduler.query(f"b-{tag}", hashes)
        part = scheduler.query(f"b-{tag}", hashes[:8])
        gone = scheduler.query(f"b-{tag}", hashes[:4])
        assert (full.num_blocks, part.num_blocks, gone.num_blocks) == (N, 8, 4)
        scheduler.release_lease(gone.lease_id)  # e.g. expired before the load
    loads = [
        {"req_id": "full", "lease_id": full.lease_id, "block_ids": DST, "sync": False},
        {"req_id": "part", "lease_id": part.lease_id, "block_ids": PART, "sync": True},
        {"req_id": "gone", "lease_id": gone.lease_id, "block_ids": GONE, "sync": False},
    ]
    loads_ok = 'code="OK",method="Load"'  # a label prefix: both transports
    load_rpcs = metric("pegaflow_rpc_seconds_count", loads_ok)
    got = all_ranks(ranks, "step", loads=loads, saves=[])
    # One Load per rank for the async requests, one for the sync one.
    assert metric("pegaflow_rpc_seconds_count", loads_ok) == load_rpcs + 2 * TP
    for r in got:
        assert r["recving"] == ["full", "gone"] and not r["pending"]
        assert r["sync_errors"] == [] and r["errors"] == sorted(GONE)
        assert r["stats"]["load_blocks"] == N + 8
        assert r["stats"]["load_failures"] == 1
    for rank, (before, w) in enumerate(zip(untouched, want, strict=True)):
        source = want[0] if mla else w  # MLA: every rank loads the one copy
        assert ranks_digest(ranks[rank], DST) == source["digests"]
        assert ranks_digest(ranks[rank], PART) == source["digests"][:8]
        assert ranks_digest(ranks[rank], GONE) == before["digests"]
    assert metric("pegaflow_active_leases") == 0  # both ranks consumed both


def ranks_digest(
    rank: RankProc, block_ids: list[int], layers: list[str] | None = None
) -> list[str]:
    rank.send("digest", block_ids=block_ids, layers=layers)
    return rank.reply("digest")["digests"]


def hybrid_round_trip(
    server: ServerProc, ranks: list[RankProc], device: str, tag: str, **shape: int
) -> None:
    """A hybrid layout through two TP ranks: a sliding-window group of
    attention layers and a Mamba state group (its own page size) in one int8
    buffer, each group a part of its own. A saves the window group's blocks
    and one state; B loads, per group, only what a hit needs (the window's
    last two blocks, the state at the boundary), each from its own part's
    lease. A request whose state lease is gone fails as a whole."""
    metric: Callable[..., float] = server.metric
    layers = shape.get("layers", 4)
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(layers - 1)]
    mixer = [f"model.layers.{layers - 1}.mixer"]
    hashes = [secrets.token_bytes(32) for _ in range(N)]
    init = dict(addr=server.addr, tp_size=TP, mla=False, device=device, **shape)
    a = all_ranks(
        ranks,
        "init",
        instance=f"ha-{tag}",
        tp_rank={"per_rank": [0, 1]},
        hybrid=True,
        **init,
    )
    parts = a[0]["parts"]
    assert sorted(parts) == [f"ha-{tag}-g0", f"ha-{tag}-g1"]
    assert all(registered for r in a for registered, _, _ in r["parts"].values())
    namespaces = {ns for _, ns, _ in parts.values()}
    slots = {slot for _, _, slot in parts.values()}
    assert len(namespaces) == 2 and len(slots) == 2  # each group its geometry
    all_ranks(ranks, "write", block_ids=SRC, seed={"per_rank": [21, 22]})
    saves = [
        {"req_id": "w", "block_ids": SRC, "hashes": [h.hex() for h in hashes]},
        {
            "req_id": "w",
            "block_ids": SRC[-1:],
            "hashes": [hashes[-1].hex()],
            "group": 1,
        },
    ]
    done = all_ranks(ranks, "step", loads=[], saves=saves)
    for r in done:
        assert not r["pending"] and r["saves_done"] == {"w": 2}
        assert r["stats"]["save_blocks"] == N + 1
    want_attn = all_ranks(ranks, "digest", block_ids=SRC, layers=attn)
    want_state = all_ranks(ranks, "digest", block_ids=SRC[-1:], layers=mixer)

    all_ranks(
        ranks,
        "init",
        instance=f"hb-{tag}",
        tp_rank={"per_rank": [0, 1]},
        hybrid=True,
        **init,
    )
    untouched = all_ranks(ranks, "digest", block_ids=DST[3:5])
    with PegaflowClient(server.addr) as scheduler:
        window = scheduler.query(f"hb-{tag}-g0", hashes)
        state = scheduler.query(f"hb-{tag}-g1", hashes[-1:])
        early = scheduler.query(f"hb-{tag}-g1", hashes[:1])  # no state there
        assert (window.num_blocks, state.num_blocks, early.num_blocks) == (N, 1, 0)
        other = scheduler.query(f"hb-{tag}-g0", hashes[-2:])
        gone = scheduler.query(f"hb-{tag}-g1", hashes[-1:])
        scheduler.release_lease(gone.lease_id)  # e.g. expired before the load
    loads = [
        {
            "req_id": "r",
            "lease_id": window.lease_id,
            "block_ids": DST[:2],
            "lease_offset": N - 2,
            "sync": False,
        },
        {
            "req_id": "r",
            "lease_id": state.lease_id,
            "block_ids": DST[2:3],
            "sync": False,
            "group": 1,
        },
        {
            "req_id": "x",
            "lease_id": other.lease_id,
            "block_ids": DST[3:5],
            "sync": False,
        },
        {
            "req_id": "x",
            "lease_id": gone.lease_id,
            "block_ids": DST[5:6],
            "sync": False,
            "group": 1,
        },
    ]
    got = all_ranks(ranks, "step", loads=loads, saves=[])
    for r in got:
        assert r["recving"] == ["r", "x"] and not r["pending"]
        # x's window blocks landed, but its state did not: x fails whole.
        assert r["failed"] == ["x"] and r["errors"] == []
        assert r["stats"]["load_blocks"] == 2 + 1 + 2
    for rank in range(TP):
        window_pages = ranks_digest(ranks[rank], DST[:2], attn)
        assert window_pages == want_attn[rank]["digests"][-2:]
        assert ranks_digest(ranks[rank], DST[2:3], mixer) == want_state[rank]["digests"]
    assert all(u["digests"] for u in untouched)
    assert metric("pegaflow_active_leases") == 0  # both ranks consumed each
