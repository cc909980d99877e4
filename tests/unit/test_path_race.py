"""`--copy-path auto` racing copy engines against kernels per size class
(pegaflow.copiers.path_race, through ContendedPolicy), fed synthetic copy
timings: no CUDA. Rates are measured ones: on session 12's H100 host
640-block loads ran at 33.5 GB/s by kernel and 46.3 by copy engines; on the
H200 kernels ~50, copy engines ~41 (benchmarks/RESULTS.md)."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from pegaflow.common.geometry import Transfers
from pegaflow.copiers.contention import ContendedPolicy
from pegaflow.copiers.measured import CROSSOVERS
from pegaflow.copiers.path_race import (
    FAST_PROBES,
    MARGIN,
    PROBE_S,
    REPROBE_S,
    SAMPLES,
)
from pegaflow.server.metrics import CopyPathCollector

PAGE = 64 << 10
BIG, SMALL = 640 * 32, 64 * 32  # pages of a 640- and a 64-block batch
H100_S12 = {"kernel": 33.5e9, "dma": 46.3e9}
H200 = {"kernel": 50e9, "dma": 41e9}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(pages: int) -> Transfers:
    a = np.arange(pages, dtype=np.uint64) * np.uint64(PAGE)
    return Transfers(a, a + np.uint64(1 << 40), np.full(pages, PAGE, np.uint64))


class Host:
    """Batches one after another on GPU 0 through the server's auto policy,
    each path at its own rate on this host; `gap` seconds between batches."""

    def __init__(self, rates: dict[str, float], gap: float = 0.05) -> None:
        self.clock = Clock()
        self.policy = ContendedPolicy(CROSSOVERS, clock=self.clock)
        self.rates, self.gap = rates, gap

    def batch(
        self, pages: int = BIG, direction: str = "load", slow: float = 1.0
    ) -> str:
        """slow: the kernel's rate is divided by it (another context computes)."""
        t = _table(pages)
        path = self.policy.choose_for(direction, t, 0)
        start = self.clock.now
        rate = self.rates[path] / (slow if path == "kernel" else 1.0)
        self.clock.now += t.total_bytes / rate
        self.policy.observe(0, direction, path, t, start, self.clock.now)
        self.clock.now += self.gap
        return path

    def run(self, n: int, **kw: object) -> list[str]:
        return [self.batch(**kw) for _ in range(n)]

    @property
    def report(self) -> dict:
        return self.policy.report()["devices"]["0"]


def test_a_host_where_copy_engines_win_moves_that_class_to_them() -> None:
    """Session 12's H100: SAMPLES batches by kernel, SAMPLES by copy engines,
    then copy engines, with one kernel batch per REPROBE_S."""
    host = Host(H100_S12)
    assert host.run(SAMPLES) == ["kernel"] * SAMPLES
    assert host.run(SAMPLES) == ["dma"] * SAMPLES  # the probes, back to back
    assert host.run(200) == ["dma"] * 200
    row = host.report["classes"][0]
    assert row["winner"] == "dma" and host.report["classes_on_dma"] == 1
    assert row["kernel_gbps"] == 33.5 and row["dma_gbps"] == 46.3
    assert host.report["race_probes"] == {"kernel": 0, "dma": SAMPLES}
    host.clock.now += REPROBE_S
    assert host.run(3) == ["kernel", "dma", "dma"]  # the loser, once
    assert host.report["race_probes"]["kernel"] == 1


def test_probes_that_never_run_alone_slow_to_one_a_second() -> None:
    """Copy threads always queued behind each other time nothing: after
    FAST_PROBES the class probes once per PROBE_S, not every other batch."""
    clock = Clock()
    policy = ContendedPolicy(CROSSOVERS, clock=clock)
    t = _table(BIG)
    for _ in range(SAMPLES):  # alone kernel batches: the class exists
        start = clock.now
        clock.now += 0.03
        policy.observe(0, "load", "kernel", t, start, clock.now)
    paths = []
    for _ in range(400):  # 10 ms apart, each queued before the last one ended
        paths.append(path := policy.choose_for("load", t, 0))
        policy.observe(0, "load", path, t, clock.now - 0.005, clock.now + 0.03)
        clock.now += 0.01
    assert paths[:FAST_PROBES] == ["dma"] * FAST_PROBES
    assert paths[FAST_PROBES:].count("dma") <= 400 * 0.01 / PROBE_S + 1


def test_a_host_where_kernels_win_keeps_them_and_probing_stays_cheap() -> None:
    """The H200: SAMPLES copy-engine probes, then kernels; afterwards one
    copy-engine batch per REPROBE_S, whatever the traffic."""
    host = Host(H200, gap=0.01)
    paths = host.run(3000)  # 0.036 s each: ~110 s of continuous loads
    assert host.report["classes"][0]["winner"] == "kernel"
    span = host.clock.now
    dma = paths.count("dma")
    assert SAMPLES <= dma <= SAMPLES + span / REPROBE_S + 1
    assert dma / len(paths) < 0.01
    assert host.report["classes_on_dma"] == 0


def test_copy_engines_within_the_margin_do_not_win() -> None:
    host = Host({"kernel": 40e9, "dma": 40e9 * (1 + MARGIN * 0.8)})
    host.run(400)
    assert host.report["classes"][0]["winner"] == "kernel"
    host = Host({"kernel": 40e9, "dma": 40e9 * (1 + MARGIN * 1.5)})
    host.run(400)
    assert host.report["classes"][0]["winner"] == "dma"


def test_size_classes_and_directions_decide_apart() -> None:
    """640-block loads may go to copy engines while 64-block loads and every
    save stay on kernels: each class races on its own times."""
    host = Host(H100_S12)
    host.run(300)  # 640-block loads: copy engines win
    host.rates = {"kernel": 31.4e9, "dma": 30.7e9}  # session 12's 64-block loads
    host.run(300, pages=SMALL)
    host.rates = {"kernel": 42.0e9, "dma": 35.0e9}
    host.run(300, direction="save")
    winners = {(r["direction"], r["batch_bytes_log2"]): r["winner"]
               for r in host.report["classes"]}  # fmt: skip
    assert winners == {
        ("load", 30): "dma",  # 1.25 GiB
        ("load", 27): "kernel",  # 128 MiB
        ("save", 30): "kernel",
    }
    # each class's batches follow its winner (after at most one re-probe)
    assert host.run(2, direction="save")[-1] == "kernel"
    host.rates = {"kernel": 31.4e9, "dma": 30.7e9}
    assert host.run(2, pages=SMALL)[-1] == "kernel"
    host.rates = H100_S12
    assert host.run(2)[-1] == "dma"


def test_small_batches_are_never_probes() -> None:
    """Launch latency swamps a 1-block batch's rate: the table decides it."""
    host = Host(H100_S12)
    for _ in range(500):
        assert host.batch(pages=32) == "kernel"  # 1-block load: 2 MiB
    assert host.report["classes"] == [] and host.report["race_probes"]["dma"] == 0


def test_a_kernel_best_taken_while_the_gpu_was_busy_is_corrected() -> None:
    """A server started while an engine computed: kernels ran time-sliced, so
    copy engines won; once the GPU is idle the kernel's re-probe sets a true
    best and the class returns to kernels."""
    host = Host(H200)
    host.run(300, slow=2.3)  # kernels at ~22 GB/s: copy engines win
    assert host.report["classes"][0]["winner"] == "dma"
    host.clock.now += REPROBE_S
    assert host.batch() == "kernel"  # the re-probe, idle
    assert host.report["classes"][0]["winner"] == "kernel"
    assert host.run(100).count("dma") == 0


def test_a_batch_queued_behind_another_is_not_timed() -> None:
    """Two copy threads on one stream: the second batch's time includes the
    first's, which says nothing about its path."""
    clock = Clock()
    policy = ContendedPolicy(CROSSOVERS, clock=clock)
    t = _table(BIG)
    seconds = t.total_bytes / 40e9
    policy.observe(0, "load", "kernel", t, 0.0, seconds)
    for i in range(1, 20):  # each queued right after the previous one started
        policy.observe(0, "load", "dma", t, (i - 1) * seconds + 1e-3, (i + 1) * seconds)
    row = policy.report()["devices"]["0"]["classes"][0]
    assert row["dma_samples"] == 0 and row["kernel_samples"] == 1


def test_metrics_render_the_race() -> None:
    host = Host(H100_S12)
    host.run(300)
    registry = CollectorRegistry()
    registry.register(CopyPathCollector(host.policy.report))
    text = generate_latest(registry).decode()
    assert 'pegaflow_copy_classes_on_dma{device="0"} 1.0' in text
    probes = host.report["race_probes"]["dma"]
    assert probes >= SAMPLES
    assert (
        f'pegaflow_copy_race_probes_total{{device="0",path="dma"}} {probes}.0' in text
    )


def test_the_race_takes_gpu_times_where_events_gave_them() -> None:
    """A threaded batch seen done late (its wake-up) is judged by its GPU
    time, as a launched one is: H200 rates, kernels stay ahead."""
    clock = Clock()
    policy = ContendedPolicy(CROSSOVERS, clock=clock)
    t = _table(BIG)
    for _ in range(3 * SAMPLES):
        path = policy.choose_for("load", t, 0)
        gpu_s = t.total_bytes / H200[path]
        wall = gpu_s + (0.004 if path == "kernel" else 0.0)  # kernels by thread
        policy.observe(0, "load", path, t, clock.now, clock.now + wall, gpu_s)
        clock.now += wall + 0.05
    (row,) = policy.report()["devices"]["0"]["classes"]
    assert row["kernel_gbps"] == round(H200["kernel"] / 1e9, 2)
    assert row["winner"] == "kernel"
