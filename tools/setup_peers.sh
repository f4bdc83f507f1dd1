#!/usr/bin/env bash
# Creates the two venvs of the peer tests (tests/peer, docs/peers.md), over Debian's python3-torch:
#   ${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}       the real DeepSpeed whose engine trains and
#       loads, pinned in tools/peer-requirements.txt, and transformers + safetensors for the
#       Hugging Face peer tests;
#   ${UCP_PEER_DSU_VENV:-$HOME/.cache/ucp/peer-venv-dsu}  a current DeepSpeed, pinned in
#       tools/peer-dsu-requirements.txt, for its ds_to_universal's ZeRO-3 path (the engine's
#       0.14.4 has none; its own engine needs torch >= 2, so it cannot replace the first).
# Idempotent: a venv made from the same requirements is left alone. Needs PyPI (or PIP_INDEX_URL)
# the first time, and python3-venv (tools/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."

# make_venv VENV REQUIREMENTS CHECK: VENV from REQUIREMENTS, kept only if CHECK (Python) runs in it.
make_venv() {
  local venv=$1 req=$2 check=$3
  local stamp=$venv/.ucp-peer-requirements  # a copy of $req, written last: the venv is complete
  if [ -x "$venv/bin/python" ] && cmp -s "$req" "$stamp"; then
    echo "setup_peers: $venv is up to date"
    return 0
  fi
  echo "setup_peers: creating $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  # Debian's interpreter, not whatever python3 is first on PATH: the torch it sees is the one
  # ucp's fixtures and tests use.
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input -q --retries 2
             --timeout 30)
  local typing_pin
  typing_pin=$(grep -E '^typing-extensions==' "$req")
  # --no-deps throughout: a dependency resolution would pull a CUDA torch over Debian's.
  if ! "${pip[@]}" install --no-deps --ignore-installed "$typing_pin" ||
     ! "${pip[@]}" install --no-deps -r "$req"; then
    rm -rf "$venv"
    echo "setup_peers: could not install the pinned packages of $req from" \
         "${PIP_INDEX_URL:-https://pypi.org/simple}: is it reachable? The peer tests" \
         "(ctest -L peer) need them; everything else runs without (ctest -LE peer)." >&2
    return 1
  fi
  if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
    "$venv/bin/python" -c "$check" >&2 || true
    rm -rf "$venv"
    echo "setup_peers: the packages of $req do not import in $venv (error above)" >&2
    return 1
  fi
  cp "$req" "$stamp"
  echo "setup_peers: $venv ready ($(du -sh "$venv" | cut -f1))"
}

status=0  # both, so that one failing does not keep the other from being made
# The first venv is only good if DeepSpeed and transformers' model classes import on this torch.
check="import deepspeed, safetensors.torch"
check+="; from transformers import GPT2LMHeadModel, LlamaForCausalLM"
make_venv "${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}" tools/peer-requirements.txt "$check" ||
  status=1
# The second only if the converter imports (its engine is never started).
make_venv "${UCP_PEER_DSU_VENV:-$HOME/.cache/ucp/peer-venv-dsu}" tools/peer-dsu-requirements.txt \
  "import deepspeed; from deepspeed.checkpoint import ds_to_universal" || status=1
exit $status
