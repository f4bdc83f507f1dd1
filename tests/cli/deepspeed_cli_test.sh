#!/usr/bin/env bash
# `ucp extract` on every DeepSpeed fixture: exit 0, and every fp32 / exp_avg / exp_avg_sq dataset
# equals (bitwise, through h5py) the full tensors the fixture was made from (expected.pt, real
# torch). Then `ucp reshard --format deepspeed-universal` writes files real torch loads, and
# `--format deepspeed` is refused with its own message.
set -euo pipefail
src=$1 bin=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$src/tests/data/deepspeed
for name in megatron_tp2_pp1_dp2_bf16 megatron_tp1_pp2_dp2_bf16 megatron_tp2_pp2_sp2_fp16_zero1 \
    deepspeed_tp1_pp1_dp4_fp16_zero2; do
  d=$data/$name
  "$bin/ucp" extract "$d" "$work/$name" >/dev/null
  /usr/bin/python3 - "$data/expected.pt" "$work/$name" <<'PY'
import json, sys, h5py, numpy as np, torch
expected = torch.load(sys.argv[1])
manifest = json.load(open(sys.argv[2] + "/manifest.json"))
params = {p["name"]: p for p in manifest["params"]}
assert set(params) == set(expected), sorted(set(params) ^ set(expected))
for name, states in expected.items():
    with h5py.File(sys.argv[2] + "/" + params[name]["file"], "r") as f:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            t = states[state]
            got = f[state][()]
            want = t.numpy()
            assert got.shape == want.shape, (name, state, got.shape, want.shape)
            assert got.tobytes() == want.tobytes(), (name, state)
print(sys.argv[2], "matches expected.pt:", len(expected), "parameters")
PY
done
first=$(ls -d "$data"/megatron_tp2_pp1_dp2_bf16)
"$bin/ucp" reshard "$work/megatron_tp2_pp1_dp2_bf16" "$work/dsu" --layout tp=2,pp=1,dp=1 \
  --format deepspeed-universal --model-states-from "$first" >/dev/null
/usr/bin/python3 - "$work/dsu" <<'PY'
import glob, sys, torch
files = glob.glob(sys.argv[1] + "/zero/*/fp32.pt")
assert files, "no zero/<param>/fp32.pt written"
for f in files:
    d = torch.load(f)
    assert d["param"].dtype == torch.float32, f
print(len(files), "DeepSpeed universal parameter files load in torch")
PY
if "$bin/ucp" reshard "$work/megatron_tp2_pp1_dp2_bf16" "$work/z" --layout tp=2 --format deepspeed 2>"$work/err"; then
  echo "--format deepspeed should be refused"; exit 1
fi
grep -q "not implemented" "$work/err"
[ ! -e "$work/z" ]
echo "deepspeed cli: ok"
