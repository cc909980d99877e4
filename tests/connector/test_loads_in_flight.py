"""The worker half's loads answered in flight (`loads_in_flight`, on by
default), over stand-ins for the client and a group's registration: which
loads name a done_event, that one answered in flight is waited for on the
connection it went out on, and that a wait that fails makes its group's
requests recompute while the other groups' load. The bytes and the real
waits: tests/gpu/test_gpu_server.py (an engine process over CUDA IPC)."""

from __future__ import annotations

import dataclasses

import pytest

from connector.extra_config import ConnectorConfig
from connector.server_calls import ServerCalls
from connector.step_plan import LoadJob
from pegaflow.common.errors import CopyFailed
from pegaflow.common.results import LoadBatchResult, LoadItemResult

CONNECTION = 17  # the client's connection for this thread, as it reports it
BLOCK = 1 << 20


@dataclasses.dataclass
class Part:
    """A group's registration: CUDA KV where `event` (its next load event)."""

    instance_id: str
    event: int = 0
    wait_error: Exception | None = None
    waits: list = dataclasses.field(default_factory=list)

    def wait_registered(self) -> bool:
        return True

    def load_event(self) -> int:
        return self.event

    def wait_loaded(self, event, timeout_s, nbytes, sent, fd) -> None:
        self.waits.append((event, timeout_s, nbytes, fd))
        if self.wait_error is not None:
            raise self.wait_error

    def lost(self, why: str) -> None:
        raise AssertionError(f"a failed wait is not a lost server: {why}")


class Client:
    """Answers every item loaded, in flight where the load named an event."""

    timeout_s, copy_grace_s = 10.0, 5.0

    def __init__(self) -> None:
        self.loads: list[tuple[str, int, int]] = []

    def load_many(self, instance_id, items, tp_rank=0, layer_seq=0, done_event=0):
        self.loads.append((instance_id, layer_seq, done_event))
        n = sum(len(it.block_ids) for it in items)
        results = tuple(
            LoadItemResult(len(it.block_ids), len(it.block_ids) * BLOCK) for it in items
        )
        return LoadBatchResult(n, n * BLOCK, results, in_flight=bool(done_event))

    def connection_fd(self) -> int:
        return CONNECTION


def jobs() -> list[LoadJob]:
    return [
        LoadJob("full", 1, [3, 4], True, group=0),
        LoadJob("window", 2, [5], True, group=1),
    ]


def test_loads_go_in_flight_by_default() -> None:
    assert ConnectorConfig().loads_in_flight


def test_a_cuda_groups_load_names_its_event_and_waits_on_its_connection() -> None:
    cuda, host = Part("gpu-part", event=3), Part("host-part")  # host KV: no event
    client = Client()
    calls = ServerCalls(client, 0, {0: cuda, 1: host}, in_flight=True)
    assert calls.load(jobs()) == set()
    assert client.loads == [("gpu-part", 0, 3), ("host-part", 0, 0)]
    assert cuda.waits == [(3, 15.0, 2 * BLOCK, CONNECTION)] and host.waits == []


@pytest.mark.parametrize("why", ["layer by layer", "turned off"])
def test_no_event_is_named_layer_by_layer_or_when_turned_off(why: str) -> None:
    cuda = Part("gpu-part", event=3)
    client = Client()
    calls = ServerCalls(client, 0, {0: cuda}, in_flight=why != "turned off")
    layer_seq = 7 if why == "layer by layer" else 0
    assert calls.load(jobs()[:1], layer_seq=layer_seq) == set()
    assert client.loads == [("gpu-part", layer_seq, 0)] and cuda.waits == []


def test_a_failed_wait_makes_its_groups_requests_recompute() -> None:
    """The server ended the connection (its copy failed) or the event never
    completed: those blocks may hold anything, so vLLM recomputes them."""
    failed = CopyFailed("done_event: 3: the server ended the connection")
    cuda = Part("gpu-part", event=3, wait_error=failed)
    other = Part("other-gpu-part", event=4)
    calls = ServerCalls(Client(), 0, {0: cuda, 1: other}, in_flight=True)
    assert calls.load(jobs()) == {"full"}
    assert calls.take_stats()["load_failures"] == 1  # the group's one job
    assert len(other.waits) == 1
