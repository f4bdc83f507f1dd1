#!/usr/bin/env bash
# One peer test (docs/peers.md): the real DeepSpeed, from the venv of tools/setup_peers.sh, against
# the ucp CLI. Usage: peer_test.sh CASE SRC_ROOT BIN_DIR WORK [ZERO]
#   train Z                 DeepSpeed trains a tiny GPT at dp=2, ZeRO-Z, on CPU and checkpoints at
#                           step 4 of 8 (WORK/zeroZ: the fixture of the three cases below)
#   ucp-reads-deepspeed Z   ucp extract of that checkpoint == ds_to_universal == zero_to_fp32
#   deepspeed-reads-ucp Z   ucp extract, then ucp reshard --format deepspeed-universal; DeepSpeed
#                           loads it at dp=1 and at dp=2 and continues the run
#   deepspeed-control Z     the same resumes without ucp: DeepSpeed's own ZeRO files at dp=2, its
#                           own ds_to_universal output at dp=1 (if these fail, the harness or
#                           DeepSpeed is at fault, not ucp)
#   deepspeed-reads-fixtures  DeepSpeed's ds_to_universal on tests/data/deepspeed == expected.pt
set -euo pipefail
test_case=$1 src=$2 bin=$3 work=$4 zero=${5:-}
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no DeepSpeed venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/ds_peer.py" "$@"; }
run=$work/zero$zero
tag() { echo "$run/ckpt/$(cat "$run/ckpt/latest")"; }

case $test_case in
  train)
    py train --work "$run" --zero "$zero"
    ;;
  ucp-reads-deepspeed)
    out=$run/ucp-reads-deepspeed
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    py extract --work "$run" --ucp "$out/universal" --out "$out/ds"
    ;;
  deepspeed-reads-ucp)
    out=$run/deepspeed-reads-ucp
    rm -rf "$out" && mkdir -p "$out"
    "$bin/ucp" extract "$(tag)" "$out/universal" --model "$src/tests/peer/gpt-peer.json"
    # Named as ds_to_universal names its output, next to latest_universal.
    "$bin/ucp" reshard "$out/universal" "$out/dsu/$(basename "$(tag)")_universal" \
      --layout tp=1,pp=1,dp=1 --format deepspeed-universal --model-states-from "$(tag)"
    status=0  # both sizes, so one failure does not hide the other's result
    for dp in 1 2; do
      py resume --work "$run" --load "$out/dsu" --dp "$dp" --mode universal \
        --ucp "$out/universal" || status=1
    done
    exit $status
    ;;
  deepspeed-control)
    out=$run/deepspeed-control
    rm -rf "$out" && mkdir -p "$out"
    py resume --work "$run" --load "$run/ckpt" --dp 2 --mode zero
    py ds-universal --work "$run" --out "$out/dsu"
    py resume --work "$run" --load "$out/dsu" --dp 1 --mode universal
    ;;
  deepspeed-reads-fixtures)
    py fixtures --data "$src/tests/data/deepspeed"
    ;;
  *)
    echo "peer_test.sh: unknown case $test_case" >&2
    exit 2
    ;;
esac
