"""The cases' own settings, checked without launching anything."""

from __future__ import annotations

import os

import pytest

from tests.real_engine.cases import CASES, Case

BIND = "VLLM_CPU_OMP_THREADS_BIND"


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
    # The ranks' lists ("0-2,5|6"), read as vLLM reads them.
    from vllm.utils.cpu_resource_utils import parse_id_list

    bound = {cpu for ranks in mask.split("|") for cpu in parse_id_list(ranks)}
    left = usable - bound
    assert left, f"{case.name}: {BIND}={mask!r} binds every CPU of {sorted(usable)}"
