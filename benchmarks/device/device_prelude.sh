# Sourced by the benchmarks/device/device_session_*.sh scripts: $OUT, stage(), and the
# carried wheels (.whl) installed into .site for the H200 machine's python3.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$SECONDS
# A stage cut by `timeout` kills pytest or the benchmark, not the servers and
# engines they started: left running, they skew the next stage (2026-12-02,
# the 12d call's transfer rows). Each stage starts by reaping them.
reap() { pkill -f -- "-m pegaflow.cli" 2>/dev/null; pkill -f -- "tests/engine_worker" \
  2>/dev/null; sleep 0.2; pkill -9 -f -- "-m pegaflow.cli" 2>/dev/null; true; }
# A stage's timeout, cut so the whole call ends before the device tool's
# limit (CALL_S) and the EXIT trap still bundles what came back.
within() { local left=$((${CALL_S:-570} - (SECONDS - START))); [ "$left" -lt 5 ] && left=5
  [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
stage() { reap; echo; echo "=== $* (t=$((SECONDS - START)) s)"; }

stage install
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl
fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

# The H200 host lacks iproute2 and some libraries Mooncake and `ip` load
# (libibverbs, libnuma, libbpf, libmnl ...): scripts that need them call
# carried_tools, which puts the carried copies (.whl/lib, .whl/bin/ip) first
# only where the host has none of its own.
carried_tools() {
  local libs lib
  libs=$(mktemp -d)
  for lib in .whl/lib/*; do
    [ -e "$lib" ] || continue
    ldconfig -p | grep -q "$(basename "$lib")" || ln -s "$PWD/$lib" "$libs/"
  done
  echo "carried libraries used: $(ls "$libs" | tr '\n' ' ')"
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ! command -v ip >/dev/null && [ -e .whl/bin/ip ]; then
    chmod +x .whl/bin/ip
    export PATH=$PWD/.whl/bin:$PATH
  fi
}

# The device tool returns a bounded number of files: a script's results go
# under $RES and come back as one $OUT/results.tgz, whatever stage it ends in.
bundle_results() {
  RES=$(mktemp -d)
  trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
}

# An A/B's base: the carried tree (`git archive REV | gzip > .ab/x.tgz`)
# unpacked at $BASE.
unpack_base() {
  BASE=/tmp/base_tree
  rm -rf "$BASE" && mkdir -p "$BASE" && tar -xzf "$1" -C "$BASE"
}

# transfer.py's Llama rows, latencies, both-at-once and SSD counters from a log.
transfer_rows() { grep -E "llama-3.1-8b \| +(64|640) |p50|both|ssd_" "$1" | cut -c1-170; }

# One transfer.py run on the Llama shape (64 and 640 blocks) with no SSD tier
# or one written behind on seal ($1: none|seal), tagged wb_$1_$2; further
# transfer.py arguments after those. The write-behind cost on the GPU path.
gpu_wb_round() {
  local tier=$1 tag=$2 ssd=/var/tmp/pf-wb-gpu; shift 2
  local extra=()
  rm -rf "$ssd"; mkdir -p "$ssd"
  [ "$tier" = seal ] && extra=(--server-arg=--ssd-cache-path=$ssd/ssd0.bin
    --server-arg=--ssd-cache-capacity=16gb --server-arg=--ssd-write-on=seal)
  timeout $(within 70) python3 benchmarks/transfer.py --shapes llama-3.1-8b \
    --sizes 64,640 --min-reps 10 --lat-reps 50 --bringup-gib 0 "${extra[@]}" "$@" \
    --tag "wb_${tier}_$tag" --out "$RES" > "$RES/wb_${tier}_$tag.log" 2>&1
  echo "rc=$?"; transfer_rows "$RES/wb_${tier}_$tag.log"
  rm -rf "$ssd"
}

# gpu_wb_round for each round label given, no tier then seal in each: the
# GPU path's write-behind cost, alternated so drift hits both alike.
gpu_wb_rounds() {
  local round tier
  for round in "$@"; do
    for tier in none seal; do
      stage "GPU path, SSD tier $tier, round $round"
      gpu_wb_round $tier $round
    done
  done
}

# ssd_writebehind.py, no tier against seal, page-aligned engine buffer:
# $1 rounds, $2 the stage's seconds at most, $3 the JSON's name; more
# ssd_writebehind.py arguments after. The write-behind cost on the host path.
host_wb() {
  local reps=$1 limit=$2 name=$3; shift 3
  timeout $(within "$limit") python3 benchmarks/ssd_writebehind.py --reps "$reps" \
    --modes none,seal --engine-align page "$@" --dir /var/tmp/pegaflow-wb-bench \
    --json "$RES/$name.json" > "$RES/$name.log" 2>&1
  echo "rc=$?"; tail -9 "$RES/$name.log"
  rm -rf /var/tmp/pegaflow-wb-bench
}

# Variant trees for an A/B, carried as .ab/NAME.tgz: unpacked at /tmp/tree_NAME.
unpack_variants() {
  local v
  for v in "$@"; do
    rm -rf "/tmp/tree_$v" && mkdir -p "/tmp/tree_$v" && tar -xzf ".ab/$v.tgz" -C "/tmp/tree_$v"
  done
}

# One round of the host path's write-behind cost: ssd_writebehind.py, no
# tier and then seal, page-aligned engine buffer, in tree $1 (main: this
# one; else /tmp/tree_$1), its JSON and log as $RES/$2.*; more
# ssd_writebehind.py arguments after those; the stage takes at most
# WB_STAGE_S seconds (default 75).
wb_round() {
  local tree=$1 name=$2 root=$PWD dir=$PWD; shift 2
  [ "$tree" = main ] || dir=/tmp/tree_$tree
  (cd "$dir" && PYTHONPATH=$root/.site:$PWD timeout $(within "${WB_STAGE_S:-75}") \
    python3 benchmarks/ssd_writebehind.py --reps 1 --modes none,seal \
    --engine-align page --dir /var/tmp/pegaflow-wb-bench --json "$RES/$name.json" "$@") \
    > "$RES/$name.log" 2>&1
  echo "rc=$?"; grep -E "median save" "$RES/$name.log"
  rm -rf /var/tmp/pegaflow-wb-bench
}

# tests/gds on each SSD backend (gpu-marked tests included), $1 seconds at
# most each, logs in $RES/gds_<backend>.log, skip reasons listed.
gds_tests() {
  local backend
  for backend in kvikio posix; do
    stage "tests/gds on $backend (gpu-marked included)"
    PEGAFLOW_TEST_SSD_BACKEND=$backend timeout $(within "$1") python3 -m pytest tests/gds \
      -o addopts="" -p no:cacheprovider -q -rfEs --timeout 60 > "$RES/gds_$backend.log" 2>&1
    echo "rc=$?"; tail -4 "$RES/gds_$backend.log"
  done
}
