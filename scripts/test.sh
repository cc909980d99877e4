#!/usr/bin/env bash
# The whole check CI runs: setup, lint, format, tests (GPU tests excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with-vllm  # the connector tests drive vLLM's scheduler
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest -q "$@"
