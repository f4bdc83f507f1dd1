#!/usr/bin/env bash
# Uneven pipeline stages (issue 14): a layout with `stages=` (layers per stage)
#   ucp:       generate at tp=2,stages=2+1+1,dp=2,zero=1; its manifests and rank files record the
#              split; reshard to the even pp=2 and back gives the same rank files byte for byte;
#              `--layout pp=3` without stages is exit 5 listing both near-even splits.
#   DeepSpeed: the uneven GPTModelPipe fixture (2 + 1 layers over pp=2, as partition_method cuts
#              it) reads bitwise equal to the torch model it was made from, its split taken from
#              the files; `--format deepspeed` writes it back at its own split and at another one,
#              each read back equal.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$src/tests/data/deepspeed
(cd "$data" && sha256sum --quiet -c SHA256SUMS)

# --- ucp formats -------------------------------------------------------------------------------
"$ucp" generate "$work/g" --model gpt-tiny --layout tp=2,stages=2+1+1,dp=2,zero=1 >/dev/null
grep -q '"layout": *"tp=2,pp=3,dp=2,sp=1,ep=1,zero=1,stages=2+1+1"' "$work/g/ucp_layout.json" \
  || { echo "ucp_layout.json does not record the stages"; head -c 400 "$work/g/ucp_layout.json"; exit 1; }
/usr/bin/python3 -c 'import json,sys,jsonschema; jsonschema.validate(json.load(open(sys.argv[1])), json.load(open(sys.argv[2])))' \
  "$work/g/ucp_layout.json" "$src/schemas/distributed.schema.json"
"$ucp" inspect "$work/g" | grep -q "^layout: *.*stages=2+1+1$"
"$ucp" verify "$work/g" >/dev/null
# Stage 0 holds layers 0 and 1 under their local names, stage 1 layer 2 as its local layer 0.
"$ucp" inspect "$work/g" --json | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["layout"].endswith("stages=2+1+1"), j["layout"]
print("inspect --json: layout", j["layout"])'
"$ucp" reshard "$work/g" "$work/even" --layout tp=1,pp=2 >/dev/null
"$ucp" inspect "$work/even" | grep -q "^layout: *tp=1,pp=2,dp=2,sp=1,ep=1,zero=1$"
"$ucp" reshard "$work/even" "$work/back" --layout tp=2,stages=2+1+1 >/dev/null
"$ucp" diff "$work/back" "$work/g" | grep -q "^equal: "
# Bitwise: every rank file of the round trip equals the generated one.
n=0
for f in $(cd "$work/g" && find . -type f ! -name '*.json' | sort); do
  cmp -s "$work/g/$f" "$work/back/$f" || { echo "rank file $f differs after the round trip"; exit 1; }
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no rank files compared"; exit 1; }
echo "ucp: tp=2,stages=2+1+1 -> tp=1,pp=2 -> tp=2,stages=2+1+1: $n rank files byte-identical"
# Universal and back at the uneven split.
"$ucp" extract "$work/g" "$work/u" >/dev/null
"$ucp" reshard "$work/u" "$work/fromu" --layout tp=2,dp=2,zero=1,stages=1+1+2 >/dev/null
"$ucp" inspect "$work/fromu" | grep -q "stages=1+1+2$"
"$ucp" diff "$work/fromu" "$work/g" | grep -q "^equal: "
# No default for an uneven split: the error lists the choices.
set +e
"$ucp" generate "$work/bad" --model gpt-tiny --layout pp=3 2>"$work/err.txt"
rc=$?
set -e
[ $rc -eq 5 ] || { echo "expected exit 5, got $rc"; cat "$work/err.txt"; exit 1; }
grep -q "4 layers not divisible by pp=3 (give the layers per stage, e.g. stages=2+1+1 .* or stages=1+1+2" \
  "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
[ "$(wc -l <"$work/err.txt")" -eq 1 ] || { echo "error is not one line"; cat "$work/err.txt"; exit 1; }
[ ! -e "$work/bad" ] || { echo "a refused generate left output"; exit 1; }
set +e
"$ucp" generate "$work/bad" --model gpt-tiny --layout stages=2+1 2>"$work/err.txt"
rc=$?
set -e
[ $rc -eq 3 ] || { echo "expected exit 3, got $rc"; cat "$work/err.txt"; exit 1; }
grep -q "per-stage counts sum to 3, model has 4" "$work/err.txt" || { cat "$work/err.txt"; exit 1; }
echo "ucp: pp=3 without stages and stages summing to 3: refused"

# --- DeepSpeed ---------------------------------------------------------------------------------
d=$data/megatron_uneven_tp2_pp2_dp2_bf16
"$ucp" inspect "$d" | grep -q "^layout: *tp=2,pp=2,dp=2,sp=1,ep=1,zero=1,stages=2+1$"
"$ucp" inspect "$d" | grep -q "^read as: *tp=2,pp=2,dp=1,sp=1,ep=1,zero=0,stages=2+1 "
"$ucp" verify "$d" >/dev/null
"$ucp" extract "$d" "$work/ds_u" >/dev/null
/usr/bin/python3 - "$data/expected_uneven.pt" "$work/ds_u" <<'PY'
import json, sys, h5py, torch
expected = torch.load(sys.argv[1])
manifest = json.load(open(sys.argv[2] + "/manifest.json"))
params = {p["name"]: p for p in manifest["params"]}
assert set(params) == set(expected), sorted(set(params) ^ set(expected))
assert manifest["source"]["layout"].endswith("stages=2+1"), manifest["source"]
for name, states in expected.items():
    with h5py.File(sys.argv[2] + "/" + params[name]["file"], "r") as f:
        for state in ("fp32", "exp_avg", "exp_avg_sq", "model"):
            got = f[state][()]
            want = states["model_bf16"].view(torch.int16) if state == "model" else states[state]
            assert got.tobytes() == want.numpy().tobytes(), (name, state)
print("deepspeed stages=2+1: extract equals expected_uneven.pt bitwise,", len(expected),
      "parameters x 4 states")
PY
# Into ucp at another split and at the even pp=1, and back to DeepSpeed at its own split and at
# another: each reads back equal.
"$ucp" convert "$d" "$work/ds_c" --format ucp --layout stages=1+2 >/dev/null
"$ucp" inspect "$work/ds_c" | grep -q "^layout: *tp=2,pp=2,dp=2,sp=1,ep=1,zero=1,stages=1+2$"
"$ucp" diff "$work/ds_c" "$work/ds_u" | grep -q "^equal: "
"$ucp" convert "$d" "$work/ds_p1" --format ucp --layout pp=1 >/dev/null
"$ucp" diff "$work/ds_p1" "$d" | grep -q "^equal: "
"$ucp" convert "$d" "$work/ds_same" --format deepspeed >/dev/null
"$ucp" inspect "$work/ds_same" | grep -q "^layout: *tp=2,pp=2,dp=2,sp=1,ep=1,zero=1,stages=2+1$"
"$ucp" diff "$work/ds_same" "$work/ds_u" | grep -q "^equal: "
# The written layer files are the fixture's: same names, same tensors (torch compares them).
/usr/bin/python3 - "$d/global_step7" "$work/ds_same/global_step7" <<'PY'
import glob, os, sys, torch
a, b = sys.argv[1], sys.argv[2]
la = sorted(os.path.basename(p) for p in glob.glob(a + "/layer_*-model_states.pt"))
lb = sorted(os.path.basename(p) for p in glob.glob(b + "/layer_*-model_states.pt"))
assert la == lb, (la, lb)
VOCAB = 50  # the fixture's; its padding rows are random there, zeros in ucp's files
for f in la:
    x, y = torch.load(os.path.join(a, f)), torch.load(os.path.join(b, f))
    assert list(x) == list(y), (f, list(x), list(y))
    tp_rank = int(f.split("-model_")[1][:2])
    for k in x:
        u, v = x[k], y[k]
        assert u.dtype == v.dtype and u.shape == v.shape, (f, k)
        if k == "word_embeddings.weight":
            valid = max(0, min(u.shape[0], VOCAB - tp_rank * u.shape[0]))
            assert not v[valid:].any(), (f, "vocabulary padding is not zero")
            u, v = u[:valid], v[:valid]
        assert torch.equal(u.view(torch.int16), v.view(torch.int16)), (f, k)
print("deepspeed -> deepspeed stages=2+1:", len(la), "layer files equal to the fixture's")
PY
"$ucp" convert "$d" "$work/ds_12" --format deepspeed --layout stages=1+2 >/dev/null
"$ucp" inspect "$work/ds_12" | grep -q "^layout: *.*stages=1+2$"
"$ucp" diff "$work/ds_12" "$work/ds_u" | grep -q "^equal: "
"$ucp" convert "$work/ds_12" "$work/ds_back" --format deepspeed --layout stages=2+1 >/dev/null
"$ucp" diff "$work/ds_back" "$d" | grep -q "^equal: "
echo "deepspeed stages=2+1 -> ucp stages=1+2, ucp pp=1, deepspeed stages=2+1, deepspeed" \
  "stages=1+2 -> stages=2+1: all equal"
echo "uneven stages cli: ok"
