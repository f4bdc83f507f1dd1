#!/usr/bin/env bash
# Conversion benchmark: gpt2-small at tp=2,pp=2,dp=2 (zero=1, bf16; ~1.7 GiB), then, in the same
# run, `cp -r` of the folder (the baseline), extract, reshard and convert, each with wall time and
# peak RSS (/usr/bin/time). Usage: tools/bench_convert.sh [BUILD_DIR] [WORK_DIR] [THREADS]
set -euo pipefail
build=${1:-build}
work=${2:-$(mktemp -d /tmp/ucp_bench_XXXXXX)}
threads=${3:-0}
ucp=$(realpath "$build")/bin/ucp
mkdir -p "$work"
cd "$work"
rm -rf src copy uni resharded converted
measure() {  # name, command...
  local name=$1; shift
  sync
  /usr/bin/time -f "%e %M" -o .time "$@" >/dev/null
  read -r wall rss_kib <.time
  printf '%-10s %8.2f s  %8.1f MiB peak RSS\n' "$name" "$wall" "$(echo "$rss_kib / 1024" | bc -l)"
  eval "wall_$name=$wall"
}
"$ucp" generate --model gpt2-small --layout tp=2,pp=2,dp=2,zero=1 --dtype bf16 --seed 1 \
  --out src --threads "$threads" >/dev/null
echo "checkpoint: $(du -sb src | cut -f1) bytes in $(ls src | wc -l) files ($(nproc) cores)"
measure cp cp -r src copy
rm -rf copy && sync
# ucp fsyncs what it writes; the fair baseline is a durable copy.
measure cp_sync bash -c "cp -r src copy && sync"
measure extract "$ucp" extract src uni --threads "$threads"
measure reshard "$ucp" reshard uni resharded --layout tp=4,pp=1,dp=2,zero=1 --threads "$threads"
measure convert "$ucp" convert src converted --layout tp=4,pp=1,dp=2,zero=1 --threads "$threads"
for op in extract reshard convert; do
  w=wall_$op
  printf '%-10s %.2fx cp -r, %.2fx cp -r + sync\n' "$op" "$(echo "${!w} / $wall_cp" | bc -l)" \
    "$(echo "${!w} / $wall_cp_sync" | bc -l)"
done
"$ucp" diff resharded converted >/dev/null && echo "reshard and convert outputs: equal"
rm -rf "$work"/{src,copy,uni,resharded,converted}
