"""The cases' own settings, checked without launching anything."""

from __future__ import annotations

import os

import pytest

from tests.real_engine.cases import CASES, Case

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bound_cpus(mask: str) -> set[int]:
    """The CPUs a `0-3,5|6`-style binding names, every rank's together."""
    cpus: set[int] = set()
    for part in mask.replace("|", ",").split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_bound_cpus_reads_ranges_and_ranks() -> None:
    assert bound_cpus("0|0") == {0}
    assert bound_cpus("0-2,5|7") == {0, 1, 2, 5, 7}


@pytest.mark.parametrize("case", CASES)
def test_a_case_that_binds_cores_leaves_one_to_the_server(case: Case) -> None:
    """vLLM's CPU workers spin between steps on the cores they are bound to:
    bound to every core (llama_pp2 once, one stage per core of a 2-vCPU VM),
    they kept the server off the CPU for 30-65 s and B missed."""
    mask = case.env.get(BIND)
    if mask in (None, "auto", "nobind"):
        return
    usable = os.sched_getaffinity(0)
    if len(usable) < 2:
        pytest.skip("one CPU: no core to leave out")
    left = usable - bound_cpus(mask)
    assert left, f"{case.name}: {BIND}={mask!r} binds every CPU of {sorted(usable)}"
