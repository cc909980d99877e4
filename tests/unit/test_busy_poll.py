"""Busy polling of socket replies (pegaflow.client.busy_poll): what the poll
reports, that it lets other threads run, the option's bounds, and real
saves and loads through a real server with it on."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import numpy as np
import pytest

from connector.extra_config import parse_config, resolved_poll
from pegaflow.client import busy_poll
from pegaflow.client.pegaflow_client import PegaflowClient
from tests.kvbuf import LocalKV, hashes

HIGH_FD = 1500  # past select()'s FD_SETSIZE


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_it_reports_bytes_sent_while_it_polls(pair) -> None:
    a, b = pair
    timer = threading.Timer(0.02, b.send, (b"x",))
    timer.start()
    try:
        assert busy_poll.wait_readable(a.fileno(), 5_000_000_000)
    finally:
        timer.cancel()
    assert a.recv(1) == b"x"  # peeked, not taken


def test_it_gives_up_after_its_time_with_nothing_to_read(pair) -> None:
    a, _ = pair
    start = time.monotonic()
    assert not busy_poll.wait_readable(a.fileno(), 30_000_000)
    assert time.monotonic() - start >= 0.029


def test_a_closed_peer_reads_as_ready(pair) -> None:
    """recv() then returns b"" at once, and the client reports the close."""
    a, b = pair
    b.close()
    assert busy_poll.wait_readable(a.fileno(), 5_000_000_000)
    assert a.recv(1) == b""


def test_a_bad_descriptor_only_costs_the_poll() -> None:
    """The caller's recv() raises the error itself."""
    start = time.monotonic()
    assert not busy_poll.wait_readable(-1, 10_000_000)
    assert time.monotonic() - start < 5


def test_other_threads_hold_the_gil_meanwhile(pair) -> None:
    """A thread that needs the GIL finishes its work while another polls for
    10 s: a poll holding the GIL would hold it up for Python's 5 ms switch
    interval per turn, or the whole poll."""
    a, b = pair
    done = threading.Event()

    def work() -> None:
        for _ in range(2000):  # 2000 GIL hand-offs
            time.sleep(0)
        done.set()
        b.send(b"x")  # ends the poll

    thread = threading.Thread(target=work)
    start = time.monotonic()
    thread.start()
    assert busy_poll.wait_readable(a.fileno(), 10_000_000_000)
    thread.join()
    assert done.is_set() and time.monotonic() - start < 9


def _waited(poller: busy_poll.ReplyPoller, fd: int, kind: str, sent_ns: int) -> float:
    start = time.monotonic()
    poller.wait(fd, kind, sent_ns)
    return time.monotonic() - start


def test_a_reply_is_polled_for_around_the_time_it_is_due(pair) -> None:
    """A kind first seen is polled for the poll's length; a kind whose
    replies take longer than the poll (a 64-block load, ~3 ms) sleeps until
    the poll's length before its reply is due and polls until as long after;
    a reply already late is slept on at once."""
    a, _ = pair
    poller = busy_poll.ReplyPoller(50_000)  # 50 ms
    assert 0.049 <= _waited(poller, a.fileno(), "new", time.perf_counter_ns()) < 0.15
    poller.took("slow", 400_000_000)  # 0.4 s
    waited = _waited(poller, a.fileno(), "slow", time.perf_counter_ns())
    assert 0.44 <= waited < 0.6  # asleep until 0.35 s, polled until 0.45
    late = time.perf_counter_ns() - 1_000_000_000
    assert _waited(poller, a.fileno(), "slow", late) < 0.05
    for _ in range(60):  # the kind speeds up: polled for from the start
        poller.took("slow", 1_000_000)
    assert 0.049 <= _waited(poller, a.fileno(), "slow", time.perf_counter_ns()) < 0.15
    idle = busy_poll.ReplyPoller(0)  # off: never polls; callers skip took()
    assert not idle.on and poller.on
    assert _waited(idle, a.fileno(), "new", time.perf_counter_ns()) < 0.05


def test_a_reply_that_comes_early_ends_the_sleep_before_the_poll(pair) -> None:
    """The sleep before a slow kind's poll wakes when the reply comes."""
    a, b = pair
    poller = busy_poll.ReplyPoller(50_000)
    poller.took("slow", 2_000_000_000)  # due in 2 s: asleep until 1.95 s
    timer = threading.Timer(0.1, b.send, (b"x",))
    timer.start()
    try:
        assert _waited(poller, a.fileno(), "slow", time.perf_counter_ns()) < 1.0
    finally:
        timer.cancel()
    assert a.recv(1) == b"x"


def test_a_socket_numbered_past_1023_sleeps_and_wakes_as_any(pair) -> None:
    """A vLLM worker holds many fds: its socket may be numbered past
    select()'s 1023, where the sleep before a slow kind's poll once raised
    ValueError."""
    a, b = pair
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= HIGH_FD:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    high = os.dup2(a.fileno(), HIGH_FD)
    try:
        poller = busy_poll.ReplyPoller(50_000)
        poller.took("slow", 2_000_000_000)
        timer = threading.Timer(0.1, b.send, (b"x",))
        timer.start()
        try:
            assert _waited(poller, high, "slow", time.perf_counter_ns()) < 1.0
        finally:
            timer.cancel()
        assert os.read(high, 1) == b"x"
        assert not busy_poll.sleep_until_readable(high, 20_000_000)  # drained
    finally:
        os.close(high)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("bad", [-2, busy_poll.MAX_BUSY_POLL_US + 1, 1.5, True, "5"])
def test_the_option_is_whole_microseconds_within_bounds(bad: object) -> None:
    with pytest.raises(ValueError, match="busy_poll_us"):
        PegaflowClient("127.0.0.1:1", busy_poll_us=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="busy_poll_us"):
        PegaflowClient("127.0.0.1:1", busy_poll_us=-1)  # auto is the connector's
    with pytest.raises(ValueError, match="kv_connector_extra_config.busy_poll_us"):
        parse_config({"busy_poll_us": bad})
    assert parse_config({"busy_poll_us": 500}).busy_poll_us == 500


@pytest.mark.parametrize(
    ("extra", "device", "us"),
    [
        ({}, "cuda", busy_poll.GPU_ENGINE_BUSY_POLL_US),  # a GPU engine polls
        ({}, "cpu", 0),  # a CPU engine's cores run its forward
        ({}, None, 0),  # vLLM did not say
        ({"busy_poll_us": -1}, "cuda", busy_poll.GPU_ENGINE_BUSY_POLL_US),
        ({"busy_poll_us": 0}, "cuda", 0),  # what the user set stands
        ({"busy_poll_us": 700}, "cpu", 700),
    ],
)
def test_the_connector_polls_by_default_on_gpu_engines_only(extra, device, us) -> None:
    config = resolved_poll(parse_config(extra), device)
    assert config.busy_poll_us == config.poll_us == us
    assert parse_config(extra).poll_us == max(extra.get("busy_poll_us", 0), 0)


def test_saves_queries_and_loads_with_busy_polling_land_every_byte(server) -> None:
    """Replies that come within the poll and after it (a 2 us poll) alike."""
    a, b = LocalKV(seed=3), LocalKV(seed=4)
    hs = hashes(8)
    for us, first in ((busy_poll.MAX_BUSY_POLL_US, 0), (2, 4)):
        with PegaflowClient(server.addr, busy_poll_us=us) as client:
            a.register(client, f"a{us}", "ns")
            b.register(client, f"b{us}", "ns")
            mine = hs[first : first + 4]
            assert client.save(f"a{us}", list(range(first, first + 4)), mine).stored
            hit = client.query(f"b{us}", mine)
            assert hit.num_blocks == 4
            client.load(f"b{us}", hit.lease_id, list(range(20 + first, 24 + first)))
    for i in range(8):
        assert np.array_equal(b.block(20 + i), a.block(i)), i
    assert server.metric(
        "pegaflow_rpc_seconds_count", 'code="OK",method="Load",transport="unix"'
    ) == pytest.approx(2)
