#!/usr/bin/env bash
# Create .venv with everything the server, the demo and the tests need.
# Idempotent and quick when nothing changed (a stamp of pyproject.toml + this file).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.pegaflow-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
echo "setting up .venv (first run takes a minute or two)" >&2
pip install --upgrade pip
# The tests' engine processes hold torch CPU tensors. 2.13.0 is the CPU build on
# local disk here; a bare 'torch' would pull a multi-GB CUDA build. The package
# itself does not depend on torch.
pip install "torch==2.13.0"
pip install -e ".[dev]"
echo "$want" > "$stamp"
