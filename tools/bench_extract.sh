#!/usr/bin/env bash
# DeepSpeed extraction benchmark (docs/PERFORMANCE.md "DeepSpeed extraction", issue 14).
# A GPT-2-small-sized Megatron-DeepSpeed checkpoint (124M parameters: hidden 768, 12 heads, 12
# layers, vocab 50257 padded to 50304, 1024 positions; GPTModel, tp=1,pp=1,dp=2, BF16_Optimizer:
# bf16 weights, fp32 masters + Adam moments in 2 bf16_zero_pp_rank_*_optim_states.pt; 1.74 GB)
# written with real torch by tools/make_deepspeed_fixtures.py, then ROUNDS rounds, each timing
# in turn:
#   cp       `cp -r` of the folder + `sync` (the baseline: ucp fsyncs what it writes)
#   ucp      ucp extract (checksums verified, the default: every zip record's CRC-32 checked
#            from the bytes the extraction reads, issue 14)
#   ucp-skip ucp extract --skip-checksums (what the checksums cost)
#   dtu      DeepSpeed's ds_to_universal (the peer venv's pinned DeepSpeed, its default workers:
#            4 extract, 2 merge) + `sync`
#   dtu-cur  the same with the current DeepSpeed of the second peer venv (tools/setup_peers.sh,
#            tools/peer-dsu-requirements.txt), when it exists
# with wall time and peak RSS from /usr/bin/time (for ds_to_universal, the largest of its
# processes). As tools/bench_convert.sh and tools/bench_hf.sh do, every measured command runs
# right after an unmeasured copy of the source is written and deleted (the page cache is warm;
# fresh memory pages of this VM cost a first touch). The first round checks that ucp read each
# source byte once (`--json` bytes_read against the folder's size). The summary gives, per
# command, the median and the best of the rounds and their ratio to cp's median and best.
# Usage: tools/bench_extract.sh [BUILD_DIR] [WORK_DIR] [ROUNDS]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
work=${2:-$(mktemp -d /tmp/ucp_bench_extract_XXXXXX)}
rounds=${3:-3}
ucp=$(realpath "$build")/bin/ucp
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
py=$venv/bin/python
if [ ! -x "$py" ]; then
  echo "bench_extract: no venv at $venv: run tools/setup_peers.sh" >&2
  exit 1
fi
want_ds=$(sed -n 's/^deepspeed==//p' "$root/tools/peer-requirements.txt")
have_ds=$("$py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
if [ "$have_ds" != "$want_ds" ]; then
  echo "bench_extract: the venv has DeepSpeed $have_ds, tools/peer-requirements.txt pins $want_ds" >&2
  exit 1
fi
# The second peer venv's DeepSpeed (a current release; only its converter runs on torch 1.13).
cur_py=${UCP_PEER_DSU_VENV:-$HOME/.cache/ucp/peer-venv-dsu}/bin/python
cur_ds=
if [ -x "$cur_py" ]; then
  cur_ds=$("$cur_py" -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
fi
ops="cp ucp ucp-skip dtu${cur_ds:+ dtu-cur}"
mkdir -p "$work"
cd "$work"
rm -rf ds copy out skip dsu .times
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(free -g | awk '/Mem:/{print $2}') GiB;" \
  "load average $(cut -d' ' -f1-3 /proc/loadavg); $(date -u +%FT%TZ);" \
  "ucp $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$root" diff --quiet 2>/dev/null || echo '+changes');" \
  "DeepSpeed $have_ds${cur_ds:+ and $cur_ds} (torch $("$py" -c 'import torch; print(torch.__version__)'))"
/usr/bin/python3 - "$root/tools" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import make_deepspeed_fixtures as m
# GPT-2 small: hidden 768, 12 heads, 12 layers, vocab 50257 (Megatron pads it to 50304 at
# make-vocab-size-divisible-by 128), 1024 positions.
model = m.Model("gpt", 768, 12, 12, 50257, 1024, 128, seed=11)
m.write_layout("ds", model, 1, 1, 2, 1, "bf16", "bf16", "gpt", True, seed=12)
PY
# ds_to_universal as DeepSpeed's own script runs it, with the peer tests' setup of DeepSpeed on
# CPU and Megatron's ModelType enum the checkpoint's args pickle (tests/peer/ds_peer.py).
cat >dtu.py <<'PY'
import sys
sys.path.insert(0, sys.argv[1] + "/tests/peer")
import ds_peer  # noqa: E402
ds_peer.megatron_enums_importable()
ds_peer.import_deepspeed()
from deepspeed.checkpoint import ds_to_universal as dtu  # noqa: E402
sys.argv = ["ds_to_universal"] + sys.argv[2:]
dtu.main(dtu.parse_arguments())
PY
size=$(du -sb ds | cut -f1)
echo "source: $size bytes ($(ls ds/global_step7 | tr '\n' ' '))"
measure() {  # name, command...
  local name=$1; shift
  cp -r ds .warm && sync && rm -rf .warm
  sync
  /usr/bin/time -f "%e %M %U %S" -o .time "$@" >.out 2>.err || { cat .err >&2; exit 1; }
  read -r wall rss_kib user sys <.time
  echo "$name $wall $rss_kib" >>.times
  printf '  %-9s %7.2f s  %8.1f MiB peak RSS  (user %5.2f s, sys %5.2f s)\n' "$name" "$wall" \
    "$(echo "$rss_kib / 1024" | bc -l)" "$user" "$sys"
}
for r in $(seq "$rounds"); do
  echo "round $r"
  measure cp bash -c "cp -r ds copy && sync"
  rm -rf copy
  measure ucp "$ucp" extract ds out --json
  if [ "$r" = 1 ]; then
    read_bytes=$(sed -n 's/^  "bytes_read": \([0-9]*\),$/\1/p' .out)
    echo "  ucp read $read_bytes bytes of the source's $size (x$(echo "$read_bytes / $size" | bc -l | cut -c1-5)), checksums verified"
    "$ucp" verify out >/dev/null && echo "  ucp verify out: ok"
  fi
  rm -rf out
  measure ucp-skip "$ucp" extract ds skip --skip-checksums
  rm -rf skip
  measure dtu bash -c "'$py' dtu.py '$root' --input_folder ds/global_step7 --output_folder dsu && sync"
  [ "$r" = 1 ] && echo "  bytes: ds_to_universal $(du -sb dsu | cut -f1)"
  rm -rf dsu
  if [ -n "$cur_ds" ]; then
    measure dtu-cur bash -c "'$cur_py' dtu.py '$root' --input_folder ds/global_step7 --output_folder dsu && sync"
    [ "$r" = 1 ] && echo "  bytes: ds_to_universal $cur_ds $(du -sb dsu | cut -f1)"
    rm -rf dsu
  fi
done
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
cp_med=$(awk '$1=="cp"{print $2}' .times | median)
cp_best=$(awk '$1=="cp"{print $2}' .times | sort -n | head -1)
echo "summary over $rounds rounds (wall: median and best, each over cp -r + sync's; max peak RSS):"
for op in $ops; do
  med=$(awk -v o=$op '$1==o{print $2}' .times | median)
  best=$(awk -v o=$op '$1==o{print $2}' .times | sort -n | head -1)
  rss=$(awk -v o=$op '$1==o{print $3}' .times | sort -n | tail -1)
  printf '  %-9s median %7.2f s  x%.2f   best %7.2f s  x%.2f   %8.1f MiB\n' "$op" "$med" \
    "$(echo "$med / $cp_med" | bc -l)" "$best" "$(echo "$best / $cp_best" | bc -l)" \
    "$(echo "$rss / 1024" | bc -l)"
done
rm -rf "$work"/{ds,copy,out,skip,dsu,.warm}
