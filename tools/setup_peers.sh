#!/usr/bin/env bash
# Creates the venv of the peer tests (tests/peer, docs/peers.md): the real DeepSpeed, pinned in
# tools/peer-requirements.txt, and transformers + safetensors for the Hugging Face peer test, over
# Debian's python3-torch. Lives at
# ${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}. Idempotent: when the venv was made from the same
# requirements it does nothing. Needs PyPI (or PIP_INDEX_URL) the first time, and python3-venv
# (tools/setup.sh installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${UCP_PEER_VENV:-$HOME/.cache/ucp/peer-venv}
req=tools/peer-requirements.txt
stamp=$venv/.ucp-peer-requirements  # a copy of $req, written last: the venv is complete

if [ -x "$venv/bin/python" ] && cmp -s "$req" "$stamp"; then
  echo "setup_peers: $venv is up to date"
  exit 0
fi

echo "setup_peers: creating $venv"
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
# Debian's interpreter, not whatever python3 is first on PATH: the torch it sees is the one ucp's
# fixtures and tests use.
/usr/bin/python3 -m venv --system-site-packages "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input -q --retries 2 --timeout 30)
typing_pin=$(grep -E '^typing-extensions==' "$req")
if ! "${pip[@]}" install --no-deps --ignore-installed "$typing_pin" ||
   ! "${pip[@]}" install --no-deps -r "$req"; then
  rm -rf "$venv"
  echo "setup_peers: could not install the pinned packages of $req from" \
       "${PIP_INDEX_URL:-https://pypi.org/simple}: is it reachable? The peer tests" \
       "(ctest -L peer) need them; everything else runs without (ctest -LE peer)." >&2
  exit 1
fi
# The venv is only good if DeepSpeed and transformers' model classes import on this torch.
check="import deepspeed, safetensors.torch; from transformers import GPT2LMHeadModel, LlamaForCausalLM"
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  "$venv/bin/python" -c "$check" >&2 || true
  rm -rf "$venv"
  echo "setup_peers: deepspeed or transformers does not import in $venv (error above)" >&2
  exit 1
fi
cp "$req" "$stamp"
echo "setup_peers: $venv ready ($(du -sh "$venv" | cut -f1))"
