#!/usr/bin/env bash
# The end-to-end example on a built-in default: installs what is missing, builds, then
#   1. generates a deterministic llama-tiny checkpoint at tp=2,pp=2,dp=2 (ZeRO-1, bf16),
#   2. converts it straight to tp=4,pp=1,dp=2 (no universal copy on disk),
#   3. extracts both to universal checkpoints and verifies them,
#   4. shows that both layouts hold the same model, bit for bit (ucp diff),
#   5. reshards the universal checkpoint to tp=1,pp=4,dp=1 (ZeRO-2) and diffs it against the source,
#   6. reads a Megatron-DeepSpeed checkpoint (a tiny LLaMA-style GPTModelPipe at tp=2,pp=2,dp=2,
#      bf16 + BF16_Optimizer, from tests/data/deepspeed) and converts it to a ucp layout and to a
#      DeepSpeed ZeRO-1 checkpoint at tp=1,pp=1,dp=4, both holding the same model bit for bit,
#   7. trains llama-tiny with ucp-train on Debian's fortunes (real English; bytes as tokens) on 2
#      MPI processes (data parallel, ZeRO-1), saving through libucp every 100 steps; one process
#      dies (SIGKILL) after step 300, tools/elastic_run.sh relaunches the job on the 1 process
#      left, which resumes from the newest checkpoint and finishes; the held-out loss ends well
#      below the corpus' unigram entropy (3.32 nats per token), and tools/plot_loss.py draws the
#      curve with the resume marked (docs/img/elastic_demo.png is one such plot).
# Usage: tools/demo.sh [work dir]   (default: a fresh temporary folder, removed afterwards)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/build.sh >/dev/null
ucp=$PWD/build/bin/ucp
work=${1:-}
if [ -z "$work" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
run() { echo "+ ucp $*"; "$ucp" "$@"; }

run generate --model llama-tiny --layout tp=2,pp=2,dp=2,zero=1 --dtype bf16 --seed 7 --out "$work/a"
run inspect "$work/a"
run convert "$work/a" "$work/b" --layout tp=4,pp=1,dp=2,zero=1
run extract "$work/a" "$work/ua"
run extract "$work/b" "$work/ub"
run verify "$work/ua"
run diff "$work/ua" "$work/ub"
run reshard "$work/ua" "$work/c" --layout tp=1,pp=4,dp=1,zero=2
run diff "$work/a" "$work/c"
ds=tests/data/deepspeed/megatron_llama_tp2_pp2_dp2_bf16
run inspect "$ds"
run convert "$ds" "$work/d" --layout tp=1 --format ucp   # pp, dp, zero kept from the source
run convert "$ds" "$work/e" --layout tp=1,pp=1,dp=4,zero=1 --format deepspeed
run diff "$work/d" "$work/e"
run diff "$ds" "$work/e"
echo "demo: every layout holds the same model, bit for bit"

# 7. Training through libucp on 2 processes, a lost process, a resume at another process count.
train=$PWD/build/bin/ucp-train
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_hwloc_base_binding_policy=none
echo "+ tools/elastic_run.sh --np 2 -- ucp-train --model llama-tiny --data fortunes --steps 600 ..."
echo "  (one process SIGKILLs itself after step 300: --kill-at 300)"
UCP_TRAIN=$train bash tools/elastic_run.sh --np 2 --zero 1 -- --model llama-tiny --data fortunes \
  --steps 600 --lr 1e-2 --min-lr 1e-3 --val-every 100 --save-every 100 --threads 1 --quiet \
  --out "$work/run" --kill-at 300 2>&1 | grep -E "^elastic_run|noticed"
python3 - "$work/run/log.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j.get("event"):
        print("  %-6s at step %3d: %s, %d process(es)" % (j["event"], j["step"], j["layout"], j.get("processes", 1)))
    elif "val_loss" in j:
        print("  step %3d: train loss %.3f, held-out loss %.3f" % (j["step"], j["loss"], j["val_loss"]))
PY
run verify "$work/run/step_00000600"
echo "+ mpirun -np 2 ucp-train ... --out $work/ref   (the same run, uninterrupted, for the plot)"
mpirun -np 2 "$train" --model llama-tiny --data fortunes --steps 600 --lr 1e-2 --min-lr 1e-3 \
  --val-every 100 --save-every 100 --threads 1 --quiet --out "$work/ref" --layout dp=2,zero=1
/usr/bin/python3 tools/plot_loss.py "$work/loss.png" "$work/ref=dp=2, uninterrupted" \
  "$work/run=dp=2, a process killed at step 300, resumed at dp=1" \
  --title "ucp-train llama-tiny on fortunes: the curve goes on after a resume at another count"
echo "demo: trained through libucp, lost a process, resumed at another count; the held-out loss"
echo "      ends well below the corpus' unigram entropy (3.32 nats per token); plot: $work/loss.png"
