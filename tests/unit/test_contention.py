"""Contention-aware `--copy-path auto` (pegaflow.copiers.contention), fed
synthetic copy timings: no CUDA. Rates are the H200's: kernels ~50 GB/s on an
idle GPU, ~22 GB/s time-sliced with another context's matmul (2026-12-01)."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pegaflow.common.geometry import Transfers
from pegaflow.common.settings import CudaConfig
from pegaflow.copiers.contention import PROBE_S, ContendedPolicy, Contention
from pegaflow.copiers.measured import CONTENTION_RATIO, CROSSOVERS
from pegaflow.copiers.path_choice import CopyPolicy
from pegaflow.server.metrics import CopyPathCollector

PAGE = 64 << 10
BIG = 640 * 32  # pages of a 640-block batch, 32 layers
IDLE, BUSY = 50e9, 22e9


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Driver:
    """Batches one after another on one GPU, each taking pages*PAGE/rate."""

    def __init__(self, gpu: Contention, clock: Clock) -> None:
        self.gpu, self.clock = gpu, clock

    def batch(self, rate: float, pages: int = BIG, direction: str = "save") -> str:
        path = self.gpu.choose(pages, pages * PAGE)
        start = self.clock.now
        # copy engines run at the rate DMA had under contention, whatever `rate`
        speed = rate if path == "kernel" else 31e9
        self.clock.now += pages * PAGE / speed
        self.gpu.observe(direction, path, pages, pages * PAGE, start, self.clock.now)
        return path


def driver(**kw: float) -> Driver:
    clock = Clock()
    return Driver(Contention(clock=clock, **kw), clock)


def test_contended_kernels_move_to_copy_engines() -> None:
    """Idle batches calibrate and stay on kernels; two time-sliced batches in
    a row switch the GPU to copy engines, where it stays under contention."""
    d = driver()
    assert [d.batch(IDLE) for _ in range(5)] == ["kernel"] * 5
    assert d.batch(BUSY) == "kernel"  # one slow batch is not enough
    assert d.batch(BUSY) == "kernel"
    assert d.gpu.choice == "dma" and d.gpu.switches == {"kernel": 0, "dma": 1}
    paths = [d.batch(BUSY) for _ in range(200)]
    assert paths.count("dma") > 180  # probes only, about one a second
    assert d.gpu.choice == "dma" and d.gpu.switches["kernel"] == 0
    assert 0 < d.gpu.probes == paths.count("kernel")


def test_an_idle_gpu_returns_to_kernels_on_the_next_probe() -> None:
    d = driver()
    for rate in [IDLE] * 3 + [BUSY] * 3:
        d.batch(rate)
    assert d.gpu.choice == "dma"
    d.clock.now += PROBE_S  # the engine stopped computing
    assert d.batch(IDLE) == "kernel"  # the probe
    assert d.gpu.choice == "kernel" and d.gpu.switches == {"kernel": 1, "dma": 1}
    assert [d.batch(IDLE) for _ in range(20)] == ["kernel"] * 20


def test_no_flapping_between_the_thresholds() -> None:
    """Ratios between enter (0.65) and exit (0.825) never switch: from kernels
    the EWMA stays above enter, from copy engines no probe reaches exit."""
    d = driver()
    d.batch(IDLE)
    for _ in range(500):
        d.batch(0.72 * IDLE)
    assert d.gpu.switches == {"kernel": 0, "dma": 0}
    d = driver()
    for rate in [IDLE] + [BUSY] * 2:
        d.batch(rate)
    for _ in range(500):
        d.batch(0.72 * IDLE)
    assert d.gpu.choice == "dma" and d.gpu.switches == {"kernel": 0, "dma": 1}
    rng = np.random.default_rng(1)  # noisy ratios around the enter threshold
    d = driver()
    d.batch(IDLE)
    for ratio in rng.uniform(0.55, 0.8, 1000):
        d.batch(ratio * IDLE)
    assert d.gpu.switches["kernel"] == 0 and d.gpu.switches["dma"] <= 1


def test_a_burst_of_tiny_batches_does_not_decide() -> None:
    """1-block saves (32 pages, 2 MiB) are launch-bound at any load: slow as
    they are, they neither calibrate nor switch, and follow the choice."""
    d = driver()
    d.batch(IDLE)
    for _ in range(1000):
        assert d.batch(1e9, pages=32) == "kernel"
    assert d.gpu.switches == {"kernel": 0, "dma": 0} and d.gpu.estimate == 1.0
    assert d.gpu.batches["kernel"] == 1001
    d.batch(BUSY), d.batch(BUSY)
    assert d.gpu.choice == "dma"
    d.clock.now += PROBE_S
    assert d.batch(IDLE, pages=32) == "dma"  # never a probe: it could not tell


def test_a_batch_queued_behind_another_is_not_timed() -> None:
    """Two threads on one stream: the second batch's wall time includes the
    first's, which is no sign of contention."""
    clock = Clock()
    gpu = Contention(clock=clock)
    nbytes = BIG * PAGE
    gpu.observe("save", "kernel", BIG, nbytes, 0.0, nbytes / IDLE)
    for i in range(1, 10):  # each queued right after the previous one started
        start, end = (i - 1) * nbytes / IDLE + 1e-3, (i + 1) * nbytes / IDLE
        gpu.observe("save", "kernel", BIG, nbytes, start, end)
    assert gpu.choice == "kernel" and gpu.estimate == 1.0
    assert gpu.batches["kernel"] == 10


def test_untrusted_times_neither_calibrate_nor_judge() -> None:
    """Batches timed while the pool was still being pinned (their times may
    be a wait for the driver's lock) are counted only: a fast one sets no
    reference and slow ones switch nothing; neither feeds the path race."""
    clock = Clock()
    policy = ContendedPolicy(clock=clock)
    t = Transfers(*(np.arange(BIG, dtype=np.uint64) * np.uint64(PAGE),) * 2,
                  np.full(BIG, PAGE, np.uint64))  # fmt: skip
    nbytes = BIG * PAGE
    for rate in (IDLE, BUSY, BUSY, BUSY):
        start = clock.now
        clock.now += nbytes / rate
        policy.observe(0, "load", "kernel", t, start, clock.now, trusted=False)
    gpu = policy.gpus[0]
    assert gpu.choice == "kernel" and gpu.estimate == 1.0
    assert gpu.batches["kernel"] == 4 and not any(b.any() for b in gpu._best.values())
    assert policy._race(0).report() == ContendedPolicy(clock=clock)._race(0).report()
    for rate in (BUSY, IDLE, BUSY, BUSY):  # the same, trusted: they decide
        start = clock.now
        clock.now += nbytes / rate
        policy.observe(0, "load", "kernel", t, start, clock.now)
    assert gpu.choice == "dma"


def test_the_first_sample_of_a_size_only_calibrates() -> None:
    """A GPU busy since start-up: no reference, no judgement; a smaller size
    class seen idle gives the larger ones a (lower) reference."""
    d = driver()
    for _ in range(10):
        d.batch(BUSY)
    assert d.gpu.choice == "kernel"
    d.batch(IDLE, pages=128)  # 8 MiB, idle
    d.batch(BUSY), d.batch(BUSY)  # 1.3 GB at 22 GB/s: below 0.65 of 50
    assert d.gpu.choice == "dma"


def test_saves_and_loads_share_one_decision_per_gpu() -> None:
    d = driver()
    d.batch(IDLE, direction="save"), d.batch(IDLE, direction="load")
    d.batch(BUSY, direction="load"), d.batch(BUSY, direction="load")
    assert d.batch(IDLE, direction="save") == "dma"  # saves follow
    d.clock.now += PROBE_S
    assert d.batch(IDLE, direction="load") == "kernel"
    assert d.batch(BUSY, direction="save") == "kernel"


def _table(pages: int) -> Transfers:
    a = np.arange(pages, dtype=np.uint64) * np.uint64(PAGE)
    return Transfers(a, a + np.uint64(1 << 40), np.full(pages, PAGE, np.uint64))


def test_policy_keeps_the_table_and_learns_per_gpu() -> None:
    """Small saves stay on copy engines (the crossover table); contention on
    GPU 0 leaves GPU 1 on kernels; /stats and /metrics see it."""
    clock = Clock()
    assert type(ContendedPolicy.from_config(CudaConfig())) is ContendedPolicy
    policy = ContendedPolicy(CROSSOVERS, clock=clock)
    big = _table(BIG)
    assert policy.choose_for("save", _table(32), 0) == "dma"
    for rate in (IDLE, BUSY, BUSY):
        path = policy.choose_for("load", big, 0)
        start = clock.now
        clock.now += big.total_bytes / rate
        policy.observe(0, "load", path, big, start, clock.now)
    assert policy.choose_for("load", big, 0) == "dma"
    assert policy.choose_for("load", big, 1) == "kernel"
    rep = policy.report()
    assert rep["devices"]["0"]["choice"] == "dma"
    assert rep["devices"]["0"]["switches_to_dma"] == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in CopyPathCollector(policy.report).collect()
        for s in m.samples
    }
    assert samples[("pegaflow_copy_contended", (("device", "0"),))] == 1.0
    assert samples[("pegaflow_copy_contended", (("device", "1"),))] == 0.0
    key = ("pegaflow_copy_path_switches_total", (("device", "0"), ("to", "dma")))
    assert samples[key] == 1
    # what /metrics serves: every family renders (a bad family breaks the scrape)
    registry = CollectorRegistry()
    registry.register(CopyPathCollector(policy.report))
    text = generate_latest(registry).decode()
    dma_batches = float(rep["devices"]["0"]["batches"]["dma"])
    assert f'pegaflow_copy_batches_total{{device="0",path="dma"}} {dma_batches}' in text
    assert 'pegaflow_copy_path_bytes_total{device="0",path="kernel"}' in text


@pytest.mark.parametrize("setting", ["kernel", "dma"])
def test_forced_paths_and_zero_keep_the_plain_policy(setting: str) -> None:
    plain = ContendedPolicy.from_config(CudaConfig(copy_path=setting))
    assert type(plain) is CopyPolicy and plain.report() == {"setting": setting}


def test_the_measured_ratio_and_its_bounds() -> None:
    """The server's auto takes the measured ratio and table; a constructor
    (tests) may pass another ratio inside (0, 1)."""
    auto = ContendedPolicy.from_config(CudaConfig())
    assert isinstance(auto, ContendedPolicy)
    assert auto.ratio == CONTENTION_RATIO == 0.65 and auto.crossovers == CROSSOVERS
    assert ContendedPolicy(ratio=0.5).report()["contention_ratio"] == 0.5
    for bad in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError, match="contention_ratio"):
            ContendedPolicy(ratio=bad)


def test_a_batch_too_long_for_the_loop_keeps_its_probe(monkeypatch) -> None:
    """CudaCopyEngine.launch refuses a batch that would hold the event loop
    too long (it goes by a copy thread). Choosing its path first used up a
    due probe: the thread's own choice then got copy engines again, so a
    GPU whose large batches never fit the loop stayed on copy engines after
    the other context stopped. The refusal now comes before the choice."""
    from types import SimpleNamespace

    from pegaflow.copiers import cuda_copier
    from pegaflow.copiers.gpu_state import Faults, InFlight, Rates

    class Queued(Exception):
        """launch got past every refusal: the batch would be queued."""

    def queued(ordinal: int) -> None:
        raise Queued

    monkeypatch.setattr(cuda_copier, "cuda_driver", SimpleNamespace(set_device=queued))
    clock = Clock()
    policy = ContendedPolicy(clock=clock)
    copier = object.__new__(cuda_copier.CudaCopyEngine)
    copier._faults, copier._pins, copier._policy = Faults(), None, policy
    copier._rates, copier._flights = Rates(), InFlight()
    t = _table(BIG)
    nbytes = t.total_bytes  # 1.3 GB: ~26 ms at IDLE, never on the loop
    copier._rates.learn((0, "load", "kernel"), nbytes, nbytes / IDLE)
    regions = SimpleNamespace(device=SimpleNamespace(ordinal=0))
    gpu = policy._gpu(0)
    for rate in (IDLE, BUSY, BUSY):  # calibrate, then contended: copy engines
        start = clock.now
        clock.now += nbytes / rate
        policy.observe(0, "load", "kernel", t, start, clock.now)
    assert gpu.choice == "dma"
    clock.now += PROBE_S  # the other context stopped; a kernel probe is due

    def probes() -> tuple[int, int]:
        return gpu.probes, sum(policy._race(0).probes.values())

    before = probes()
    assert copier.launch("load", regions, t) is None  # too long: by a thread
    assert probes() == before  # the refusal took no probe...
    for _ in range(8):  # ...so the thread's batches get them, kernels among them
        path = policy.choose_for("load", t, 0)
        start = clock.now
        clock.now += nbytes / IDLE
        policy.observe(0, "load", path, t, start, clock.now)
        if gpu.choice == "kernel":
            break
        clock.now += PROBE_S
    assert gpu.choice == "kernel"
    # a batch that fits the loop is still launched on it
    small = _table(64)
    with pytest.raises(Queued):
        copier.launch("load", regions, small)
