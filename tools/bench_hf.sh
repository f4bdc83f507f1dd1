#!/usr/bin/env bash
# Hugging Face import/export benchmark (docs/PERFORMANCE.md "Hugging Face import/export").
# A gpt2-medium-sized GPT2LMHeadModel (355M parameters, random init) saved by transformers'
# save_pretrained (tools/bench_hf.py make), then ROUNDS rounds, each timing in turn:
#   cp         `cp -r` of the HF folder + `sync` (the baseline: ucp fsyncs what it writes)
#   import     ucp convert HF ckpt --layout tp=2,pp=2 --format ucp (HF -> ucp distributed)
#   cp-ckpt    `cp -r` of the import's output + `sync`: a copy of the bytes the import writes
#              (2.3x the source's: the weights as the model state and as the fp32 master)
#   export     ucp convert ckpt out --format hf               (ucp distributed -> HF)
#   export16   ucp convert ckpt out --format hf --dtype bf16  (the same, cast on the way)
#   hf2hf      ucp convert HF out --format hf                 (HF -> HF, no ucp checkpoint)
#   tf         transformers from_pretrained + save_pretrained + os.sync (tools/bench_hf.py)
# with wall time and peak RSS from /usr/bin/time. As tools/bench_convert.sh does (its header says
# why), every measured command runs right after an unmeasured copy of the source is written and
# deleted; the page cache is warm (the source was just read). The summary gives medians and their
# ratio to the median cp. The first round checks the outputs: `ucp diff` of the source against
# the export, the HF -> HF copy and transformers' own save.
# Usage: tools/bench_hf.sh [BUILD_DIR] [WORK_DIR] [ROUNDS] [SOURCE_DTYPE fp32|bf16]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
work=${2:-$(mktemp -d /tmp/ucp_bench_hf_XXXXXX)}
rounds=${3:-3}
dtype=${4:-fp32}
ucp=$(realpath "$build")/bin/ucp
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
py=$venv/bin/python
if [ ! -x "$py" ]; then
  echo "bench_hf: no venv at $venv: run tools/setup_peers.sh" >&2
  exit 1
fi
mkdir -p "$work"
cd "$work"
rm -rf hf copy ckpt ckpt-copy out out16 hf2hf tf .times
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(free -g | awk '/Mem:/{print $2}') GiB;" \
  "load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ);" \
  "ucp $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet 2>/dev/null || echo '+changes')"
"$py" "$root/tools/bench_hf.py" make --out hf --dtype "$dtype" 2>&1 | grep -v Warning
"$py" "$root/tools/bench_hf.py" import 2>&1 | grep -v Warning
echo "source: $(du -sb hf | cut -f1) bytes ($(ls hf | tr '\n' ' '))"
measure() {  # name, command...
  local name=$1; shift
  cp -r hf .warm && sync && rm -rf .warm
  sync
  /usr/bin/time -f "%e %M %U %S" -o .time "$@" >/dev/null 2>.err || { cat .err >&2; exit 1; }
  read -r wall rss_kib user sys <.time
  echo "$name $wall $rss_kib" >>.times
  printf '  %-9s %7.2f s  %8.1f MiB peak RSS  (user %5.2f s, sys %5.2f s)\n' "$name" "$wall" \
    "$(echo "$rss_kib / 1024" | bc -l)" "$user" "$sys"
  grep '^transformers:' .err | sed 's/^/            /' || true
}
for r in $(seq "$rounds"); do
  echo "round $r"
  measure cp bash -c "cp -r hf copy && sync"
  rm -rf copy
  measure import "$ucp" convert hf ckpt --layout tp=2,pp=2 --format ucp
  measure cp-ckpt bash -c "cp -r ckpt ckpt-copy && sync"
  rm -rf ckpt-copy
  measure export "$ucp" convert ckpt out --format hf
  measure export16 "$ucp" convert ckpt out16 --format hf --dtype bf16
  measure hf2hf "$ucp" convert hf hf2hf --format hf
  measure tf "$py" "$root/tools/bench_hf.py" roundtrip --src hf --out tf
  if [ "$r" = 1 ]; then
    echo "  bytes: ckpt $(du -sb ckpt | cut -f1), export $(du -sb out | cut -f1)," \
      "export bf16 $(du -sb out16 | cut -f1), transformers $(du -sb tf | cut -f1)"
    for o in out hf2hf tf; do
      "$ucp" diff hf "$o" >/dev/null && echo "  ucp diff hf $o: equal"
    done
  fi
  rm -rf ckpt out out16 hf2hf tf
done
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
cp_med=$(awk '$1=="cp"{print $2}' .times | median)
echo "summary over $rounds rounds (median wall, its ratio to the median cp -r + sync, max peak RSS):"
for op in cp import cp-ckpt export export16 hf2hf tf; do
  med=$(awk -v o=$op '$1==o{print $2}' .times | median)
  rss=$(awk -v o=$op '$1==o{print $3}' .times | sort -n | tail -1)
  printf '  %-9s %7.2f s  x%.2f  %8.1f MiB\n' "$op" "$med" "$(echo "$med / $cp_med" | bc -l)" \
    "$(echo "$rss / 1024" | bc -l)"
done
imp_med=$(awk '$1=="import"{print $2}' .times | median)
ckpt_med=$(awk '$1=="cp-ckpt"{print $2}' .times | median)
printf '  import against a copy of the bytes it writes (cp-ckpt): x%.2f\n' \
  "$(echo "$imp_med / $ckpt_med" | bc -l)"
rm -rf "$work"/{hf,copy,ckpt,ckpt-copy,out,out16,hf2hf,tf}
