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
#   7. trains llama-tiny with ucp-train on Debian's fortunes (real English; bytes as tokens),
#      saving through libucp every 100 steps, kills the trainer with SIGKILL after a checkpoint,
#      resumes from the newest complete checkpoint at another ZeRO stage, and finishes: the
#      held-out loss ends well below the corpus' unigram entropy (3.32 nats per token).
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
run convert "$ds" "$work/d" --layout tp=1,pp=2,dp=2,zero=1
run convert "$ds" "$work/e" --layout tp=1,pp=1,dp=4,zero=1 --format deepspeed
run diff "$work/d" "$work/e"
run diff "$ds" "$work/e"
echo "demo: every layout holds the same model, bit for bit"

# 7. Training through libucp, a crash, and a resume (docs/train.md).
train=$PWD/build/bin/ucp-train
echo "+ ucp-train --model llama-tiny --data fortunes --steps 600 --lr 1e-2 --save-every 100 --out $work/run &"
"$train" --model llama-tiny --data fortunes --steps 600 --lr 1e-2 --min-lr 1e-3 --val-every 100 \
  --save-every 100 --out "$work/run" > "$work/train1.log" &
pid=$!
until [ -f "$work/run/step_00000200/ucp_layout.json" ] || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done
kill -9 $pid 2>/dev/null || true
wait $pid 2>/dev/null || true
tail -n 3 "$work/train1.log"
echo "demo: killed the trainer (SIGKILL) after $(tail -n 1 "$work/train1.log" | awk '{print $2}') steps"
echo "+ ucp-train --resume $work/run --layout tp=1,pp=1,dp=1,zero=2"
"$train" --resume "$work/run" --layout tp=1,pp=1,dp=1,zero=2 | grep -E "resumed|val loss"
run verify "$work/run/step_00000600"
run inspect "$work/run/step_00000600" | head -n 3
echo "demo: trained, killed, resumed; the final held-out loss is above (unigram entropy 3.32 nats)"
