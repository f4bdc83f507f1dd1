#!/usr/bin/env bash
# One Hugging Face peer test (docs/hf.md): transformers 4.47.1 + safetensors 0.4.5 from the venv of
# tools/setup_peers.sh against the ucp CLI.
# Usage: hf_peer_test.sh CASE SRC_ROOT BIN_DIR WORK LAYOUT [refused]
# A tiny random model of CASE (hf_peer.py) saved by save_pretrained is imported by ucp at LAYOUT
# (`ucp convert orig dist --layout LAYOUT --format ucp`), converted back to tp=1,pp=1, exported with
# `--format hf` (the original's shard size when it is sharded), and reloaded by transformers:
# every tensor and model(ids).logits bitwise equal to the original's (fp32).
# CASE megatron_* (LAYOUT "-"): that Megatron-DeepSpeed fixture of tests/data/deepspeed exported
# with `ucp convert FIXTURE OUT --format hf`, in its training dtype, with --dtype fp32 and (fp16
# runs) --dtype bf16; its logits in transformers against the PyTorch reference (hf_peer.py
# megatron).
# A 6th argument `refused` (a layout the rule set cannot hold, e.g. tp neither a divisor nor a
# multiple of the KV heads, or not dividing the heads): the import must fail with exit code 5
# (failed_precondition) and a message naming the rule.
set -euo pipefail
test_case=$1 src=$2 bin=$3 work=$4 layout=$5 expect=${6:-}
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/hf_peer.py" "$@"; }
if [[ $test_case == megatron_* ]]; then
  dir=$work/$test_case
  rm -rf "$dir" && mkdir -p "$dir"
  data=$src/tests/data/deepspeed
  "$bin/ucp" convert "$data/$test_case" "$dir/hf" --format hf
  "$bin/ucp" convert "$data/$test_case" "$dir/hf-fp32" --format hf --dtype fp32
  py megatron --data "$data" --fixture "$test_case" --exported "$dir/hf" --state model
  py megatron --data "$data" --fixture "$test_case" --exported "$dir/hf-fp32" --state fp32
  if [[ $test_case == *fp16* ]]; then  # a cast: bf16 from the fp32 masters, nearest even
    "$bin/ucp" convert "$data/$test_case" "$dir/hf-bf16" --format hf --dtype bf16
    py megatron --data "$data" --fixture "$test_case" --exported "$dir/hf-bf16" --state bf16
  fi
  exit 0
fi
dir=$work/$test_case-${layout//[=,]/_}
rm -rf "$dir" && mkdir -p "$dir"
py make --case "$test_case" --out "$dir"
shard=()
[ -f "$dir/orig/model.safetensors.index.json" ] && shard=(--max-shard-size 60KB)
"$bin/ucp" inspect "$dir/orig" | head -3
if [ "$expect" = refused ]; then
  rc=0
  "$bin/ucp" convert "$dir/orig" "$dir/dist" --layout "$layout" --format ucp 2>"$dir/err" || rc=$?
  cat "$dir/err"
  if [ "$rc" != 5 ] || ! grep -q "not divisible by tp=" "$dir/err" || [ -e "$dir/dist" ]; then
    echo "FAIL: expected the import at $layout to be refused (exit 5), got exit $rc" >&2
    exit 1
  fi
  echo "$test_case at $layout: refused as expected (exit 5), nothing written"
  exit 0
fi
"$bin/ucp" convert "$dir/orig" "$dir/dist" --layout "$layout" --format ucp
"$bin/ucp" verify "$dir/dist"
"$bin/ucp" convert "$dir/dist" "$dir/back" --layout tp=1,pp=1
"$bin/ucp" convert "$dir/back" "$dir/exported" --format hf "${shard[@]}"
# The export of the import is the import: ucp's own diff of the two HF folders.
"$bin/ucp" diff "$dir/orig" "$dir/exported"
py check --case "$test_case" --dir "$dir" --exported "$dir/exported"
# Llama-family cases: the tp slices of dist are Megatron-Core's linear_qkv (hf_peer.py tp-qkv).
[[ $test_case == gpt2* ]] || py tp-qkv --case "$test_case" --dir "$dir"
