# Sourced by the benchmarks/device_session_*.sh scripts: $OUT, stage(), and the
# carried wheels (.whl) installed into .site for the H200 machine's python3.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$SECONDS
stage() { echo; echo "=== $* (t=$((SECONDS - START)) s)"; }

stage install
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
