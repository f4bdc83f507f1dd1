#!/usr/bin/env bash
# DeepSpeed-MoE written by ucp, loaded by the real DeepSpeed 0.14.4 (docs/peers.md): the engine
# trains the mixtral-style MoE model at dp=4, ep=2 on CPU / gloo (tests/peer/ds_moe_peer.py) and
# checkpoints at step 7; ucp converts that checkpoint with --format deepspeed
#   * to the same layout: every file equals the engine's, key by key and tensor by tensor;
#   * to dp=2 ep=2, dp=2 ep=1 and dp=4 ep=4: a fresh engine at that layout loads it with its
#     plain load_checkpoint, holds the saved state bitwise, and continues the run (losses within
#     ds_moe_peer.py's tolerances);
#   * from dp=2 ep=1 back to dp=4 ep=2: every file equals the engine's again, and the engine
#     continues the run bit for bit.
# Usage: moe_writer_peer_test.sh SRC_ROOT BIN_DIR WORK
set -euo pipefail
src=$1 bin=$2 work=$3
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "peer: no DeepSpeed venv at $venv: run tools/setup_peers.sh (it needs PyPI)" >&2
  exit 1
fi
py() { "$venv/bin/python" "$src/tests/peer/ds_moe_peer.py" "$@"; }
run=$work/moe-writer
model=(--model "$src/tests/data/deepspeed/models/mixtral-plain.json")
py train --work "$run" --dp 4 --ep 2
to() {  # FROM NAME DP EP: ucp's --format deepspeed conversion of FROM to $run/NAME
  rm -rf "${run:?}/$2"
  "$bin/ucp" convert "$1" "$run/$2" --layout "dp=$3,ep=$4" --format deepspeed "${model[@]}" >/dev/null
}
to "$run/ckpt" same 4 2
py files --engine "$run/ckpt" --ucp "$run/same"
for layout in "2 2" "2 1" "4 4"; do
  set -- $layout
  to "$run/ckpt" "dp$1_ep$2" "$1" "$2"
  py resume --work "$run" --load "$run/dp$1_ep$2" --dp "$1" --ep "$2"
done
to "$run/dp2_ep1" back 4 2
py files --engine "$run/ckpt" --ucp "$run/back"
py resume --work "$run" --load "$run/back" --dp 4 --ep 2
echo "ok: DeepSpeed-MoE written by ucp at dp=4 ep=2 (same files), dp=2 ep=2, dp=2 ep=1, dp=4 ep=4 and back loaded by the engine"
