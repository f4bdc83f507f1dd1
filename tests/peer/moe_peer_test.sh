#!/usr/bin/env bash
# DeepSpeed-MoE peer test (docs/peers.md): the real DeepSpeed 0.14.4 trains a mixtral-style model
# whose MLPs are deepspeed.moe.layer.MoE layers (4 experts, ep_size EP) at dp=DP on CPU / gloo and
# checkpoints (expert files, expp_rank files, expert param groups partitioned over dp / ep);
# ucp verify and ucp extract read it, and the extraction equals the engine's fp32 master, Adam
# moments and step bitwise (tests/peer/ds_moe_peer.py). As the harness's control, a fresh engine
# at the same dp and ep loads the engine's own checkpoint with the saved state bitwise and the
# same losses (the check a DeepSpeed-MoE writer's output will be put through).
# Usage: moe_peer_test.sh SRC_ROOT BIN_DIR WORK DP EP
set -euo pipefail
src=$1 bin=$2 work=$3 dp=$4 ep=$5
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no DeepSpeed venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/ds_moe_peer.py" "$@"; }
run=$work/moe-dp$dp-ep$ep
model=$src/tests/data/deepspeed/models/mixtral-plain.json
py train --work "$run" --dp "$dp" --ep "$ep"
"$bin/ucp" verify "$run/ckpt" --model "$model"
rm -rf "$run/universal"
"$bin/ucp" extract "$run/ckpt" "$run/universal" --model "$model"
py extract --work "$run" --ucp "$run/universal"
py resume --work "$run" --load "$run/ckpt" --dp "$dp" --ep "$ep"
