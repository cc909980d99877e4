#!/usr/bin/env bash
# Issue 5 on the H200 machine, in one call: install kvikio from the carried
# wheels, say whether it loads and in which mode (GDS or POSIX compat), run the
# SSD tier's tests on the kvikio backend, then benchmarks/ssd.py with kvikio and
# with POSIX on the same disk; logs and JSON land in $OUT, a short table last.
#   run from the repo root with .whl carried (kvikio-cu13, libkvikio-cu13,
#   rapids-logger, blake3, pytest & co: see benchmarks/RESULTS_ssd.md)
# Stage limits (s): TEST_S, KVIKIO_S, POSIX_S; BENCH_ARGS goes to both benches.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
START=$SECONDS
stage() { echo; echo "=== $* (t=$((SECONDS - START)) s)"; }

PY=${PY:-python3}  # PY=.venv/bin/python: a dry run on a dev machine
stage install
rm -rf .site
if ! $PY -m pip install -q --no-index --no-deps --target .site .whl/*.whl; then
  echo "one install of all wheels failed: installing them one by one"
  for w in .whl/*.whl; do
    $PY -m pip install -q --no-index --no-deps --target .site "$w" 2>&1 | tail -1 \
      || true
  done
fi
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
BENCH_DIR=${BENCH_DIR:-/var/tmp/pegaflow-ssd-bench}
mkdir -p "$BENCH_DIR"
df -h "$BENCH_DIR" | tail -1
findmnt -no SOURCE,FSTYPE,OPTIONS -T "$BENCH_DIR" || true

stage "kvikio check"
$PY - <<'EOF' 2>&1 | tee "$OUT/kvikio_check.log"
import os, sys, tempfile, traceback

def diag(why):
    print(f"KVIKIO NOT USABLE: {why}")
    print("python", sys.version.split()[0], sys.executable)
    for mod in ("numpy", "cupy", "cuda.pathfinder", "cuda.bindings", "rapids_logger",
                "libkvikio", "blake3", "tqdm"):
        try:
            m = __import__(mod, fromlist=["_"])
            print(f"  {mod}: {getattr(m, '__version__', '?')} at {getattr(m, '__file__', '?')}")
        except Exception as exc:  # a diagnostic: say what failed and go on
            print(f"  {mod}: import failed: {exc!r}")
    os.system("ls /usr/lib/x86_64-linux-gnu/libcuda.so* 2>&1 | head -3;"
              "ldconfig -p | grep -E 'libcufile|libcuda.so' | head -5;"
              "python3 -m pip list 2>/dev/null | grep -iE 'cufile|pathfinder|kvikio|cupy'")
    sys.exit(1)

try:
    import kvikio
except Exception:
    traceback.print_exc()
    diag("import kvikio failed (traceback above)")
print("kvikio", kvikio.__version__, "from", os.path.dirname(kvikio.__file__))
try:
    import kvikio.defaults as d
    print("compat_mode setting:", d.get("compat_mode"),
          "-> resolved compat:", d.is_compat_mode_preferred())
    for k in ("num_threads", "task_size", "auto_direct_io_read", "auto_direct_io_write"):
        print(f"  {k} = {d.get(k)}")
except Exception:
    traceback.print_exc()
from pegaflow.gds import kvikio_io
why = kvikio_io.unavailable()
if why:
    diag(why)
import numpy as np
with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
    path = os.path.join(tmp, "probe.bin")
    with open(path, "wb") as f:
        f.truncate(8 << 20)
    try:
        io = kvikio_io.KvikioIO([path], 8)
        src = np.random.default_rng(0).integers(0, 256, 4 << 20, np.uint8)
        dst = np.zeros_like(src)
        io.pwrite(0, src.ctypes.data, src.nbytes, 4096)
        io.pread(0, dst.ctypes.data, dst.nbytes, 4096)
        print("mode:", io.mode, "| O_DIRECT:", io.files[0].is_direct_io_supported(),
              "| 4 MiB round trip equal:", bool((src == dst).all()))
        io.close()
    except Exception:
        traceback.print_exc()
        diag("CuFile open / pread / pwrite failed (traceback above)")
EOF
CHECK_RC=${PIPESTATUS[0]}
KVIKIO_OK=0
[ "$CHECK_RC" = 0 ] && KVIKIO_OK=1

if [ "$KVIKIO_OK" = 1 ]; then
  stage "tests/gds on the kvikio backend (+ the gpu-marked kvikio tests)"
  PEGAFLOW_TEST_SSD_BACKEND=kvikio timeout "${TEST_S:-80}" $PY -m pytest tests/gds \
    -o addopts="" -p no:cacheprovider -q -rfEs --timeout 60 2>&1 \
    | tee "$OUT/tests_kvikio.log" | tail -25
  stage "kvikio benchmark"
  timeout "${KVIKIO_S:-140}" $PY benchmarks/ssd.py --backend kvikio --dir "$BENCH_DIR" \
    --json "$OUT/ssd_kvikio_h200.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_kvikio.log" | tail -32
else
  echo "kvikio unusable (see above / kvikio_check.log): skipping its tests and benchmark"
fi

stage "posix benchmark (same disk, same run)"
timeout "${POSIX_S:-110}" $PY benchmarks/ssd.py --backend posix --dir "$BENCH_DIR" \
  --json "$OUT/ssd_posix_h200.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_posix.log" | tail -8

stage summary
$PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
runs = {}
for b in ("kvikio", "posix"):
    p = os.path.join(out, f"ssd_{b}_h200.json")
    if os.path.exists(p):
        runs[b] = json.load(open(p))
if not runs:
    sys.exit("no benchmark JSON written")
for b, r in runs.items():  # a run cut short has rows and no later stages
    mode = r["rows"][0]["mode"] if r.get("rows") else "?"
    rec = r.get("recovery")
    tail = (f"; recovery of {rec['blocks']} blocks: journal "
            f"{rec['recover_journal_s']} s, scan {rec['recover_scan_s']} s"
            if rec else f"; stopped in {r.get('interrupted_in', r.get('stage'))}")
    print(f"{b}: mode {mode}, checksum {r['checksum']}{tail}")
rows = {b: {(x["block_KiB"], x["depth"]): x for x in r["rows"]} for b, r in runs.items()}
keys = sorted(set().union(*rows.values()))
head = "block_KiB depth " + " ".join(
    f"{b[:6]}_w {b[:6]}_r w/dd r/dd" for b in runs)
print(head)
for k in keys:
    cells = []
    for b in runs:
        x = rows[b].get(k)
        cells.append("  -" if x is None else f"{x['write_GBps']:7.3f} {x['read_GBps']:7.3f} "
                     f"{x['write/dd']:4} {x['read/dd']:4}")
    print(f"{k[0]:9} {k[1]:5} " + " ".join(cells))
EOF
echo "total $((SECONDS - START)) s"
