#!/usr/bin/env bash
# Create .venv with everything the server, the demo and the tests need.
#   scripts/setup.sh               server, demo, tests without vLLM
#   scripts/setup.sh --with-vllm   also vLLM 0.33 (lean CPU install) for the
#                                  connector tests; scripts/test.sh uses this
# Idempotent and quick when nothing changed (stamps of what each part installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    *) echo "usage: $0 [--with-vllm]" >&2; exit 2 ;;
  esac
done
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# The remote tier's transfer engine (Mooncake) links libibverbs and libnuma even
# for TCP. Installed here when we may (root with apt), else named.
system_libs() {
  local missing=()
  for lib in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1; do
    ldconfig -p | grep -q "${lib%%:*}" || missing+=("${lib##*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (the remote tier's transfer engine needs them)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null ||
      { apt-get update -q >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
  else
    echo "note: install ${missing[*]} for the remote tier (apt-get install ${missing[*]})" >&2
  fi
}

# A fresh .venv with vLLM takes ~4.5 GiB, and pip unpacks wheels in the temp
# directory first: a full disk would stop pip midway with a bare ENOSPC.
NEED_MIB=6144
free_space() {
  local dir avail
  for dir in . "${TMPDIR:-/tmp}"; do
    avail=$(df -Pm "$dir" | awk 'NR == 2 {print $4}')
    if [ "${avail:-0}" -lt "$NEED_MIB" ]; then
      echo "error: $(cd "$dir" && pwd) has ${avail} MiB free; a fresh .venv needs" \
        "~${NEED_MIB} MiB there. Free disk space (old clones, /tmp/pytest-of-*)" \
        "or point TMPDIR at a larger disk." >&2
      exit 1
    fi
  done
}

base() {
  local stamp=.venv/.pegaflow-setup want
  want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/python ]; then
    return 0
  fi
  free_space
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  echo "setting up .venv (first run takes a minute or two)" >&2
  pip install --upgrade pip
  # The tests' engine processes hold torch CPU tensors. 2.13.0 is the CPU build on
  # local disk here; a bare 'torch' would pull a multi-GB CUDA build. The package
  # itself does not depend on torch.
  pip install "torch==2.13.0"
  pip install -e ".[dev]"
  rm -f .venv/.pegaflow-vllm  # base packages may have moved under vLLM's
  echo "$want" > "$stamp"
}

# vLLM 0.33 without its CUDA stack ("lean CPU install"): the
# wheel without dependencies, then its pure-Python requirements
# (requirements/vllm-0.33-lean.txt). Enough for the real Scheduler on CPU.
# pip reports that vllm wants torch 2.14.0 and its CUDA kernels, and that
# grpcio-tools (dev only, for scripts/gen_proto.py) wants protobuf < 6: harmless.
# Those and only those are left out of `pip check` (lean_pip_check); any other
# conflict stops the setup.
LEAN_OMITTED='^vllm 0\.33\.0 requires (fastsafetensors|flashinfer-python|humming-kernels|instanttensor|nvidia-cudnn-frontend|nvidia-cutlass-dsl|nvtx|pynvvideocodec|quack-kernels|tilelang|tokenspeed-mla|torchaudio|torchcodec|torchvision), which is not installed\.$'
LEAN_OMITTED+='|^vllm 0\.33\.0 has requirement torch==2\.14\.0, but you have torch 2\.13\.0\+cpu\.$'
LEAN_OMITTED+='|^grpcio-tools 1\.71\.2 has requirement protobuf<6\.0dev,>=5\.26\.1, but you have protobuf [0-9.]+\.$'
lean_pip_check() {
  local left
  left=$(.venv/bin/python -m pip check 2>&1 | grep -Ev "$LEAN_OMITTED" || true)
  if [ -n "$left" ]; then
    echo "pip check, less what the lean vLLM install leaves out on purpose:" >&2
    echo "$left" >&2
    return 1
  fi
}

lean_vllm() {
  local stamp=.venv/.pegaflow-vllm want
  want=$(cat requirements/vllm-0.33-lean.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  free_space
  echo "installing vLLM 0.33 (lean CPU install, a few minutes the first time)" >&2
  pip install --no-deps "vllm==0.33.0"
  pip install -r requirements/vllm-0.33-lean.txt
  .venv/bin/python -c "import vllm.v1.core.sched.scheduler" 2>/dev/null
  lean_pip_check
  echo "$want" > "$stamp"
}

system_libs
base
[ "$with_vllm" = 0 ] || lean_vllm
