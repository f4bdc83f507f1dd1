#!/usr/bin/env bash
# Conversion benchmark: gpt2-small at tp=2,pp=2,dp=2 (zero=1, bf16; 2.1 GiB in 8 rank files),
# then ROUNDS rounds, each timing in turn a durable copy (`cp -r` + `sync`, the baseline: ucp
# fsyncs what it writes), `ucp extract`, `ucp reshard` of that extract to tp=4,pp=1,dp=2 and
# `ucp convert` of the source to the same layout, and `ucp diff` of source and converted output
# (logical content at two layouts), with wall time and peak RSS (/usr/bin/time).
# On this VM, writing into memory that was freed more than a second or two before costs several
# times more than into memory freed just now (the hypervisor takes freed pages back), so every
# measured command, baseline included, runs right after an unmeasured copy of the source is
# written and deleted: all of them start with the same recently freed memory. The rounds
# interleave baseline and ucp, and the summary gives medians and the ratio of medians.
# Usage: tools/bench_convert.sh [BUILD_DIR] [WORK_DIR] [THREADS] [ROUNDS] [EXTRA UCP ARGS...]
set -euo pipefail
build=${1:-build}
work=${2:-$(mktemp -d /tmp/ucp_bench_XXXXXX)}
threads=${3:-0}
rounds=${4:-3}
shift $(($# < 4 ? $# : 4))
extra=("$@")
ucp=$(realpath "$build")/bin/ucp
mkdir -p "$work"
cd "$work"
rm -rf src copy uni resharded converted .times
measure() {  # name, command...
  local name=$1; shift
  cp -r src .warm && sync && rm -rf .warm
  sync
  /usr/bin/time -f "%e %M" -o .time "$@" >/dev/null
  read -r wall rss_kib <.time
  echo "$name $wall $rss_kib" >>.times
  printf '  %-8s %7.2f s  %7.1f MiB peak RSS\n' "$name" "$wall" "$(echo "$rss_kib / 1024" | bc -l)"
}
"$ucp" generate --model gpt2-small --layout tp=2,pp=2,dp=2,zero=1 --dtype bf16 --seed 1 \
  --out src --threads "$threads" >/dev/null
echo "checkpoint: $(du -sb src | cut -f1) bytes in $(ls src | wc -l) files ($(nproc) cores)"
for r in $(seq "$rounds"); do
  echo "round $r"
  measure cp bash -c "cp -r src copy && sync"
  rm -rf copy
  measure extract "$ucp" extract src uni --threads "$threads" "${extra[@]}"
  measure reshard "$ucp" reshard uni resharded --layout tp=4,pp=1,dp=2,zero=1 --threads "$threads" \
    "${extra[@]}"
  measure convert "$ucp" convert src converted --layout tp=4,pp=1,dp=2,zero=1 --threads "$threads" \
    "${extra[@]}"
  measure diff "$ucp" diff src converted --threads "$threads"
  if [ "$r" = 1 ]; then
    "$ucp" diff resharded converted >/dev/null && echo "  reshard and convert outputs: equal"
  fi
  rm -rf uni resharded converted
done
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
cp_med=$(awk '$1=="cp"{print $2}' .times | median)
echo "summary over $rounds rounds (median wall, its ratio to the median durable copy, max RSS):"
for op in cp extract reshard convert diff; do
  med=$(awk -v o=$op '$1==o{print $2}' .times | median)
  rss=$(awk -v o=$op '$1==o{print $3}' .times | sort -n | tail -1)
  printf '  %-8s %7.2f s  x%.2f  %7.1f MiB\n' "$op" "$med" "$(echo "$med / $cp_med" | bc -l)" \
    "$(echo "$rss / 1024" | bc -l)"
done
rm -rf "$work"/{src,copy,uni,resharded,converted}
