#!/usr/bin/env bash
# One Hugging Face peer test (docs/hf.md): transformers 4.47.1 + safetensors 0.4.5 from the venv of
# tools/setup_peers.sh against the ucp CLI. Usage: hf_peer_test.sh CASE SRC_ROOT BIN_DIR WORK LAYOUT
# A tiny random model of CASE (hf_peer.py) saved by save_pretrained is imported by ucp at LAYOUT
# (`ucp convert orig dist --layout LAYOUT`), converted back to tp=1,pp=1, exported with
# `--format hf` (the original's shard size when it is sharded), and reloaded by transformers:
# every tensor and model(ids).logits bitwise equal to the original's (fp32).
set -euo pipefail
test_case=$1 src=$2 bin=$3 work=$4 layout=$5
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/hf_peer.py" "$@"; }
dir=$work/$test_case-${layout//[=,]/_}
rm -rf "$dir" && mkdir -p "$dir"
py make --case "$test_case" --out "$dir"
shard=()
[ -f "$dir/orig/model.safetensors.index.json" ] && shard=(--max-shard-size 60KB)
"$bin/ucp" inspect "$dir/orig" | head -3
"$bin/ucp" convert "$dir/orig" "$dir/dist" --layout "$layout"
"$bin/ucp" verify "$dir/dist"
"$bin/ucp" convert "$dir/dist" "$dir/back" --layout tp=1,pp=1
"$bin/ucp" convert "$dir/back" "$dir/exported" --format hf "${shard[@]}"
# The export of the import is the import: ucp's own diff of the two HF folders.
"$bin/ucp" diff "$dir/orig" "$dir/exported"
py check --case "$test_case" --dir "$dir" --exported "$dir/exported"
