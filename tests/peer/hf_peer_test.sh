#!/usr/bin/env bash
# One Hugging Face peer test (docs/hf.md): transformers 4.47.1 + safetensors 0.4.5 from the venv of
# tools/setup_peers.sh against the ucp CLI.
# Usage: hf_peer_test.sh CASE SRC_ROOT BIN_DIR WORK LAYOUT [refused]
# A tiny random model of CASE (hf_peer.py) saved by save_pretrained is imported by ucp at LAYOUT
# (`ucp convert orig dist --layout LAYOUT --format ucp`), converted back to tp=1,pp=1, exported with
# `--format hf` (the original's shard size when it is sharded), and reloaded by transformers:
# every tensor and model(ids).logits bitwise equal to the original's (fp32).
# CASE rotary-interleaved (LAYOUT "-"): an interleaved-rotary Megatron model (see below).
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
if [ "$test_case" = rotary-interleaved ]; then
  # An interleaved-rotary Megatron model (docs/hf.md "Rotary pairing"): the LLaMA fixture's
  # weights read as Megatron --rotary-interleaved's, once from args.rotary_interleaved (a copy of
  # the fixture whose args say so) and once from --rotary-layout; both exports permute q/k per
  # head; transformers' logits equal the interleaved reference, and the half-split export's
  # visibly do not.
  fixture=megatron_llama_tp2_pp2_dp2_bf16
  data=$src/tests/data/deepspeed
  dir=$work/rotary-interleaved
  rm -rf "$dir" && mkdir -p "$dir"
  cp -r "$data/$fixture" "$dir/fx"
  py set-rotary-interleaved --dir "$dir/fx"
  "$bin/ucp" inspect "$dir/fx" | grep -i rotary
  "$bin/ucp" convert "$dir/fx" "$dir/hf" --format hf --dtype fp32
  "$bin/ucp" convert "$data/$fixture" "$dir/hf-opt" --format hf --dtype fp32 --rotary-layout interleaved
  "$bin/ucp" convert "$data/$fixture" "$dir/hf-half" --format hf --dtype fp32
  cmp "$dir/hf/model.safetensors" "$dir/hf-opt/model.safetensors"
  echo "args.rotary_interleaved and --rotary-layout interleaved: the same bytes"
  if cmp -s "$dir/hf/model.safetensors" "$dir/hf-half/model.safetensors"; then
    echo "FAIL: the interleaved and half-split exports are equal" >&2
    exit 1
  fi
  py megatron --data "$data" --fixture "$fixture" --exported "$dir/hf" --state fp32 \
    --rotary interleaved --wrong "$dir/hf-half"
  py megatron --data "$data" --fixture "$fixture" --exported "$dir/hf-half" --state fp32 \
    --rotary half-split --wrong "$dir/hf"
  # The args and the option must agree.
  rc=0
  "$bin/ucp" convert "$dir/fx" "$dir/bad" --format hf --rotary-layout half-split 2>"$dir/err" || rc=$?
  cat "$dir/err"
  if [ "$rc" = 0 ] || ! grep -q "contradicts" "$dir/err" || [ -e "$dir/bad" ]; then
    echo "FAIL: a --rotary-layout the args contradict was not refused (exit $rc)" >&2
    exit 1
  fi
  # HF (the training dtype's export) -> an interleaved ucp checkpoint (recorded) -> HF: bitwise;
  # and its rank files hold the fixture's own rows: every model slice equal to the fixture's
  # converted directly to the same layout.
  "$bin/ucp" convert "$dir/fx" "$dir/hf-bf16" --format hf
  "$bin/ucp" convert "$dir/hf-bf16" "$dir/ilv" --format ucp --layout tp=2,pp=2 --rotary-layout interleaved
  grep -o '"rotary_interleaved": *1' "$dir/ilv/ucp_layout.json"
  "$bin/ucp" convert "$dir/ilv" "$dir/hf-rt" --format hf
  cmp "$dir/hf-bf16/model.safetensors" "$dir/hf-rt/model.safetensors"
  cmp "$dir/hf-bf16/config.json" "$dir/hf-rt/config.json"
  echo "HF -> interleaved tp=2,pp=2 -> HF: bitwise"
  "$bin/ucp" convert "$dir/fx" "$dir/fx-ucp" --format ucp --layout tp=2,pp=2
  py same-slices --a "$dir/fx-ucp" --b "$dir/ilv" --padded "word_embeddings|output_layer" --vocab 50
  exit 0
fi
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
