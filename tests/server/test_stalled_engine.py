"""An engine whose registered memory stalls the server's copy: block 0's pages
fault into a userfaultfd the engine never reads (tests/uffd_stall.py; a FUSE
file mapped over registered memory does the same), so the server's
process_vm_readv of them waits until the engine exits. docs/security.md names
the case. Real server, real engine processes, root only (a privileged
engine's userfaultfd is what catches another process's fault)."""

from __future__ import annotations

import os
import secrets
import threading

import pytest

from pegaflow.copiers.host_copier import HostCopyEngine
from tests.procs import EngineProc, ServerProc, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (userfaultfd)")

# bf16 pages of 4 heads x 16 tokens x 2 x 64: 16 KiB per layer and block, so
# block 0 holds whole 4 KiB pages to stall
SHAPES = dict(layout="LBNHC", layers=2, blocks=16, heads=4, block_size=16, head=64)


def _stalled_save(server: ServerProc, engines) -> tuple[EngineProc, EngineProc, str]:
    """Engine "stalls" has a 1-block save waiting in the server's copy;
    engine "bystander" is registered beside it. The stalled save's hash."""
    stuck, other = engines(), engines()
    for engine, name, seed in ((stuck, "stalls", 1), (other, "bystander", 2)):
        engine.call("init", seed=seed, **SHAPES)
        engine.call("register", addr=server.addr, instance=name, namespace="ns")
    try:
        stuck.call("stall", block=0)
    except RuntimeError as exc:  # a kernel without userfaultfd
        pytest.skip(f"cannot stall pages here: {exc}")
    token = secrets.token_hex(32)
    stuck.call("save_async", block_ids=[0], hashes=[token])

    def reserved() -> bool:  # its slot (the pool was empty): the copy follows
        return server.metric("pegaflow_pool_used_bytes") > 0

    assert wait_until(reserved, 30), "the stalled save never reached the server"
    return stuck, other, token


def test_an_engine_that_stalls_a_copy_and_dies_leaves_the_server_serving(
    server, engines
) -> None:
    """Its death ends the wait (the copy fails, nothing is published) and the
    server serves the others again, its pool intact."""
    stuck, other, token = _stalled_save(server, engines)
    stuck.kill()
    fresh = secrets.token_hex(32)
    assert other.call("save", block_ids=[3], hashes=[fresh], timeout=30)["stored"] == 1
    assert other.call("query", hashes=[fresh])["num_blocks"] == 1
    assert other.call("query", hashes=[token])["num_blocks"] == 0  # never published
    assert server.proc.poll() is None


def test_other_engines_are_served_while_one_engine_copy_stalls(server, engines) -> None:
    """Regression (2026-12-06): a copy of up to 2 MiB ran inline on the
    event loop, so the bystander's save ended DEADLINE_EXCEEDED ("no answer
    on the socket") while the stalled copy waited. Its copies now run on the
    registration's own lane; everyone else's save, query and load go on."""
    stuck, other, token = _stalled_save(server, engines)
    try:
        fresh = [secrets.token_hex(32) for _ in range(8)]
        saved = other.call("save", block_ids=list(range(8)), hashes=fresh, timeout=10)
        assert saved["stored"] == 8
        hit = other.call("query", hashes=fresh, timeout=10)
        assert hit["num_blocks"] == 8
        loaded = other.call(
            "load", lease_id=hit["lease_id"], block_ids=list(range(8, 16)), timeout=10
        )
        assert loaded["loaded"] == 8
        digests = other.call("digest", block_ids=list(range(16)))["digests"]
        assert digests[:8] == digests[8:]
        assert other.call("query", hashes=[token])["num_blocks"] == 0  # still copying
    finally:
        stuck.kill()  # the server's copy ends: the teardown can stop it
    assert server.proc.poll() is None


def test_registering_reads_no_page_of_the_engine(server, engines) -> None:
    """Regression (2026-12-06): registration read one byte of the engine's
    first region on the event loop, to learn of ptrace permission, so an
    engine whose first page stalled stopped every engine as it registered.
    The kernel is now asked with a read of an address nothing maps."""
    stuck, other = engines(), engines()
    other.call("init", seed=2, **SHAPES)
    other.call("register", addr=server.addr, instance="bystander", namespace="ns")
    stuck.call("init", seed=1, page_aligned=True, **SHAPES)
    try:
        stuck.call("stall_start")
    except RuntimeError as exc:
        pytest.skip(f"cannot stall pages here: {exc}")
    try:
        got = stuck.call(
            "register", addr=server.addr, instance="stalls", namespace="ns", timeout=20
        )
        assert got["slot_bytes"] > 0
        fresh = secrets.token_hex(32)
        assert other.call("save", block_ids=[1], hashes=[fresh], timeout=10)["stored"]
    finally:
        stuck.kill()


def test_the_check_before_each_copy_reads_no_page_of_the_engine(engines) -> None:
    """Regression (2026-12-06): the exec check before every copy batch read a
    byte of the engine's first region through /proc/<pid>/mem, a copy of a
    fully shared (memfd) registration ran inline on the event loop, so a
    stalled first page stopped every engine at its next copy. The check now
    reads an address nothing maps (EIO while the address space lives)."""
    engine = engines()
    engine.call("init", seed=1, page_aligned=True, **SHAPES)
    try:
        got = engine.call("stall_start")
    except RuntimeError as exc:
        pytest.skip(f"cannot stall pages here: {exc}")
    copier = HostCopyEngine()
    opened = []
    done = threading.Event()

    def open_and_check() -> None:  # on a thread: the old check never returned
        opened.append(copier.open(engine.proc.pid, [tuple(r) for r in got["regions"]]))
        opened[0].image.check("save")
        done.set()

    try:
        threading.Thread(target=open_and_check, daemon=True).start()
        assert done.wait(10), "the check is waiting on the engine's stalled page"
    finally:
        engine.kill()  # a stalled read ends (EIO or EOF) once the engine is gone
        for regions in opened:
            copier.close(regions)


def test_a_save_deduplicated_against_one_that_then_fails_is_stored(
    server, engines
) -> None:
    """Scenario: engine "stalls" has block `token` in flight (its copy
    waits on a stalled page); the bystander saves the same hash. It was
    answered "deduplicated" at once, and when the stalled copy failed (its
    engine died) nothing held the block: acknowledged, then a miss. Now the
    bystander's save waits for the other copy's outcome and, that copy
    failed, copies its own bytes: stored, and served byte-equal."""
    stuck, other, token = _stalled_save(server, engines)
    answer: list[dict] = []
    saver = threading.Thread(
        target=lambda: answer.append(
            other.call("save", block_ids=[3], hashes=[token], timeout=30)
        )
    )
    saver.start()
    # Long enough for the save to meet the stalled one (the old answer came
    # at once); the outcome below holds whenever the other engine dies.
    saver.join(1.0)
    stuck.kill()
    saver.join(30)
    assert answer and (answer[0]["stored"], answer[0]["deduplicated"]) == (1, 0)
    hit = other.call("query", hashes=[token])
    assert hit["num_blocks"] == 1
    other.call("load", lease_id=hit["lease_id"], block_ids=[9])
    digests = other.call("digest", block_ids=[3, 9])["digests"]
    assert digests[0] == digests[1]


def test_a_save_deduplicated_against_one_still_stalled_is_not_acknowledged(
    server, engines
) -> None:
    """Scenario: as above, but the stalled copy outlives the bystander's
    save: at its deadline the bystander's block is neither stored by it nor
    landed, and the answer says so (rejected), instead of "deduplicated"
    against a copy that never ends."""
    stuck, other, token = _stalled_save(server, engines)
    try:
        got = other.call("save", block_ids=[3], hashes=[token], timeout=30)
        assert (got["stored"], got["deduplicated"], got["rejected"]) == (0, 0, 1)
        assert other.call("query", hashes=[token])["num_blocks"] == 0
    finally:
        stuck.kill()
    assert server.proc.poll() is None
