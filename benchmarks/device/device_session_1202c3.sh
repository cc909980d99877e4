#!/usr/bin/env bash
# 2026-12-02, third session, third H200 call (~7 min):
#   1. where the write-behind cost left after the batched eviction spills
#      (-9 to -12 % in `seal`) lies: `seal` saves on this tree, on a copy whose
#      writers release each slice at once (no checksum, header or write), and
#      on a copy that does everything but the pwritev; `none` beside them;
#      3 rounds interleaved, full size
#   (with VARIANTS=hash: the checksum skipped; the checksum and the write
#    skipped; one writer thread instead of two -- what of the writers' work
#    costs the save)
#   2. remote.py over veth (64 MiB - 1 GiB) on the 16-core host, after the
#      fix that let its Mooncake-alone helper find Mooncake on PYTHONPATH
# Run from the repo root with .whl carried; results in one $OUT/results.tgz.
. "$(dirname "$0")/device_prelude.sh"
WB_DIR=${WB_DIR:-/var/tmp/pegaflow-wb-bench}
mkdir -p "$WB_DIR"
RES=$(mktemp -d)
trap 'tar czf "$OUT/results.tgz" -C "$RES" . 2>/dev/null' EXIT
SITE=$PWD/.site

variant() {  # a copy of this tree with one sed applied to one file
  local name=$1 file=$2 expr=$3 dir
  dir=$(mktemp -d)
  tar --exclude=./.site --exclude=./.whl --exclude=./.git --exclude=./.ab \
    --exclude=./.venv -cf - . | tar -xf - -C "$dir"
  sed -i "$expr" "$dir/$file"
  grep -q "VARIANT" "$dir/$file" || { echo "variant $name: the sed matched nothing"; exit 1; }
  echo "$dir"
}
NOWRITE=$(variant nowrite gds/tier.py \
  's/^\( *\)self\._write_batch(slices, buf)$/\1_release_range(slices, 0, sum(s.hi - s.lo for s in slices))  # VARIANT/')
NOSYSCALL=$(variant nosyscall gds/store.py \
  's/^\( *\)self\.io\.pwritev(run\[0\]\.file, iov, run\[0\]\.offset)$/\1pass  # VARIANT/')
NOHASH=$(variant nohash gds/records.py \
  's/^\( *\)rec\.checksum = hash_parts(rec\.checksum_id, views)$/\1rec.checksum = 0  # VARIANT/')
BOOKONLY=$(variant bookonly gds/records.py \
  's/^\( *\)rec\.checksum = hash_parts(rec\.checksum_id, views)$/\1rec.checksum = 0  # VARIANT/')
sed -i 's/^\( *\)self\.io\.pwritev(run\[0\]\.file, iov, run\[0\]\.offset)$/\1pass  # VARIANT/' \
  "$BOOKONLY/gds/store.py"
ONEWRITER=$(variant onewriter gds/config.py 's/^    write_threads: int = 2$/    write_threads: int = 1  # VARIANT/')
if [ "${VARIANTS:-}" = hash ]; then
  RUNS="main:none main:seal nohash:seal bookonly:seal onewriter:seal"
else
  RUNS="main:none main:seal nowrite:seal nosyscall:seal"
fi

stage "write-behind variants, 3 rounds"
for rep in 1 2 3; do
  for v in $RUNS; do
    tree=${v%%:*} mode=${v#*:}
    case $tree in main) dir=$PWD ;; nowrite) dir=$NOWRITE ;; nosyscall) dir=$NOSYSCALL ;;
      nohash) dir=$NOHASH ;; bookonly) dir=$BOOKONLY ;; onewriter) dir=$ONEWRITER ;; esac
    (cd "$dir" && PYTHONPATH=$SITE:$dir timeout 60 python3 benchmarks/ssd_writebehind.py \
      --reps 1 --modes "$mode" --dir "$WB_DIR" --json "$RES/wb_${tree}_${mode}_$rep.json" \
      > "$RES/wb_${tree}_${mode}_$rep.log" 2>&1) || echo "$v rep $rep failed"
  done
done

[ -n "${SKIP_REMOTE:-}" ] || {
stage "remote tier over veth"
carried_tools
timeout "${REMOTE_S:-240}" python3 benchmarks/remote.py --sizes-mib 64,256,1024 \
  --repeat 3 --json "$RES/remote.json" > "$RES/remote.log" 2>&1
echo "remote rc=$?"
tail -12 "$RES/remote.log"
}

stage "summary"
python3 benchmarks/writebehind_summary.py --cells "$RES"
stage done
