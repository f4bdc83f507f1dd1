#!/usr/bin/env bash
# DeepSpeed folders through every `ucp` command, on every fixture of tests/data/deepspeed:
#   extract: every fp32 / exp_avg / exp_avg_sq / model dataset equals (bitwise, through h5py) the
#            tensors the fixture was made from (expected*.pt, real torch);
#   inspect / verify: exit 0, inspect shows DeepSpeed's own layout beside the ucp view;
#   convert DS -> ucp layout with another tp, then diff against DS and against the extraction;
#   extract -> reshard -> extract round-trips (diff equal);
#   convert --format deepspeed to another DeepSpeed layout, diff against DS and the extraction.
# Then `ucp reshard --format deepspeed-universal` writes files real torch loads, and each bad
# input (--format deepspeed ones too) is one error line with its exit code and no output.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$src/tests/data/deepspeed
# The fixtures are what tools/make_deepspeed_fixtures.py writes, byte for byte.
(cd "$data" && sha256sum --quiet -c SHA256SUMS)

# name | expected file | --model | a ucp layout of another tp | a ucp layout to reshard to |
# a DeepSpeed layout to convert to (the fixture's naming)
cases="megatron_tp2_pp1_dp2_bf16|expected.pt||tp=4,pp=2,dp=1,zero=1|tp=1,pp=1,dp=2,zero=2|tp=1,pp=1,dp=3,zero=2
megatron_tp1_pp2_dp2_bf16|expected.pt||tp=2,pp=1,dp=2,zero=2|tp=4,pp=1,dp=1|tp=2,pp=2,dp=1,zero=1
megatron_tp2_pp2_sp2_fp16_zero1|expected.pt||tp=1,pp=2,dp=3,zero=1|tp=2,pp=2,dp=2,sp=2,zero=3|tp=4,pp=1,dp=2,zero=2
deepspeed_tp1_pp1_dp4_fp16_zero2|expected.pt|$data/models/gpt-plain.json|tp=2,pp=1,dp=2,zero=1|tp=4,pp=2,dp=1|tp=2,pp=1,dp=1,zero=1
megatron_llama_tp2_pp2_dp2_bf16|expected_llama.pt||tp=1,pp=1,dp=2,zero=2|tp=2,pp=2,dp=1,zero=1|tp=1,pp=2,dp=4,zero=1
megatron_llama_tp2_pp1_dp2_fp16_zero1|expected_llama.pt||tp=1,pp=2,dp=1|tp=2,pp=1,dp=3,zero=2|tp=2,pp=1,dp=2,sp=2,zero=2
deepspeed_mixtral_tp1_pp1_dp2_bf16_zero1|expected_mixtral.pt|$data/models/mixtral-plain.json|tp=2,pp=1,dp=2,ep=2,zero=1|tp=1,pp=2,dp=4,ep=4,zero=2|tp=2,pp=1,dp=2,zero=1"

while IFS='|' read -r name expected model other reshard dslayout; do
  d=$data/$name
  m=()
  [ -n "$model" ] && m=(--model "$model")
  "$ucp" extract "$d" "$work/$name" "${m[@]}" >/dev/null
  /usr/bin/python3 - "$data/$expected" "$work/$name" <<'PY'
import json, sys, h5py, torch
expected = torch.load(sys.argv[1])
manifest = json.load(open(sys.argv[2] + "/manifest.json"))
params = {p["name"]: p for p in manifest["params"]}
assert set(params) == set(expected), sorted(set(params) ^ set(expected))
client = json.loads(manifest["client_state"]) if isinstance(manifest["client_state"], str) \
    else manifest["client_state"]
assert "ucp_model" in client and "deepspeed" in client, sorted(client)
for name, states in expected.items():
    with h5py.File(sys.argv[2] + "/" + params[name]["file"], "r") as f:
        for state in ("fp32", "exp_avg", "exp_avg_sq", "model"):
            got = f[state][()]
            if state == "model":
                want = states["model_" + params[name]["dtype"]]
                want_bytes = want.view(torch.int16).numpy().tobytes()
            else:
                want = states[state]
                want_bytes = want.numpy().tobytes()
            assert got.shape == tuple(want.shape), (name, state, got.shape, want.shape)
            assert got.tobytes() == want_bytes, (name, state)
print(sys.argv[2], "matches", sys.argv[1].split("/")[-1] + ":", len(expected), "parameters x 4 states")
PY
  "$ucp" inspect "$d" "${m[@]}" >"$work/inspect.txt"
  grep -q "^source: .*deepspeed tp=" "$work/inspect.txt"
  # DeepSpeed's own layout first (issue 15 #8), the ucp view it is read as after.
  grep -q "^layout: .*zero=[12]$" "$work/inspect.txt"
  grep -q "^read as: .*dp=1,.*zero=0 (the ucp view of it)" "$work/inspect.txt"
  "$ucp" inspect "$d" "${m[@]}" --json | /usr/bin/python3 -c \
    'import json,sys; j=json.load(sys.stdin); assert j["format"] == "deepspeed" and j["source_layout"], j'
  "$ucp" verify "$d" "${m[@]}" >/dev/null
  "$ucp" convert "$d" "$work/$name.c" --layout "$other" --format ucp "${m[@]}" >/dev/null
  "$ucp" diff "$work/$name.c" "$d" "${m[@]}" | grep -q "^equal: "
  "$ucp" diff "$work/$name.c" "$work/$name" | grep -q "^equal: "
  "$ucp" reshard "$work/$name" "$work/$name.r" --layout "$reshard" >/dev/null
  "$ucp" extract "$work/$name.r" "$work/$name.u2" >/dev/null
  "$ucp" diff "$work/$name.u2" "$work/$name" | grep -q "^equal: "
  # DeepSpeed -> DeepSpeed: the written folder records its model, so no --model reads it back.
  "$ucp" convert "$d" "$work/$name.ds" --layout "$dslayout" --format deepspeed "${m[@]}" >/dev/null
  "$ucp" diff "$work/$name.ds" "$work/$name" | grep -q "^equal: "
  "$ucp" verify "$work/$name.ds" >/dev/null
  echo "$name: extract, inspect, verify, convert to $other, diff, reshard to $reshard," \
    "convert to DeepSpeed $dslayout: ok"
done <<<"$cases"

first=$data/megatron_tp2_pp1_dp2_bf16
"$ucp" reshard "$work/megatron_tp2_pp1_dp2_bf16" "$work/dsu" --layout tp=2,pp=1,dp=1 \
  --format deepspeed-universal --model-states-from "$first" >/dev/null
/usr/bin/python3 - "$work/dsu" <<'PY'
import glob, sys, torch
files = glob.glob(sys.argv[1] + "/zero/*/fp32.pt")
assert files, "no zero/<param>/fp32.pt written"
for f in files:
    d = torch.load(f)
    assert d["param"].dtype == torch.float32, f
assert any("language_model.encoder.layers.0" in f for f in files), "GPTModel names expected"
print(len(files), "DeepSpeed universal parameter files load in torch")
PY

# expect_fail CODE TEXT -- COMMAND...: exit CODE, one stderr line holding TEXT, no output folder.
expect_fail() {
  local code=$1 text=$2
  shift 3
  set +e
  "$@" >/dev/null 2>"$work/err"
  local got=$?
  set -e
  if [ "$got" != "$code" ] || ! grep -qF -- "$text" "$work/err" || [ "$(wc -l <"$work/err")" != 1 ]; then
    echo "expected exit $code and \"$text\" from: $*"; echo "got exit $got:"; cat "$work/err"; exit 1
  fi
  [ ! -e "$work/out" ] || { echo "output left behind by: $*"; exit 1; }
}
bad() { rm -rf "$work/bad"; cp -r "$data/$1" "$work/bad"; echo "$work/bad/global_step7"; }

b=$(bad megatron_tp2_pp1_dp2_bf16)
rm "$b/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
expect_fail 4 "lacks bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" -- "$ucp" extract "$work/bad" "$work/out"

b=$(bad megatron_tp2_pp2_sp2_fp16_zero1)
f=$b/zero_pp_rank_1_mp_rank_03_optim_states.pt
truncate -s $(($(stat -c %s "$f") / 2)) "$f"
expect_fail 6 "zero_pp_rank_1_mp_rank_03_optim_states.pt" -- "$ucp" convert "$work/bad" "$work/out" --layout tp=1

b=$(bad megatron_llama_tp2_pp2_dp2_bf16)
f=$b/bf16_zero_pp_rank_0_mp_rank_02_optim_states.pt
off=$(/usr/bin/python3 -c 'import struct, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
i = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
raw = open(sys.argv[1], "rb").read()
n, m = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
print(i.header_offset + 30 + n + m + 8)  # a byte inside the largest partition' "$f")
printf '\x7f' | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
expect_fail 6 "crc32 mismatch in record" -- "$ucp" extract "$work/bad" "$work/out"
expect_fail 6 "bf16_zero_pp_rank_0_mp_rank_02_optim_states.pt" -- "$ucp" verify "$work/bad"

sed 's/"ffn_hidden": 64/"ffn_hidden": 48/' "$data/models/gpt-plain.json" >"$work/wrong.json"
expect_fail 5 "param_shapes in mp_rank_00_model_states.pt say [64, 16]" -- \
  "$ucp" extract "$data/deepspeed_tp1_pp1_dp4_fp16_zero2" "$work/out" --model "$work/wrong.json"
expect_fail 3 'hyper-parameter "heads" of family gpt is unknown' -- \
  "$ucp" inspect "$data/deepspeed_tp1_pp1_dp4_fp16_zero2"
expect_fail 5 'model "gpt-tiny" has layers=4' -- \
  "$ucp" convert "$data/megatron_tp2_pp1_dp2_bf16" "$work/out" --layout tp=1 --model gpt-tiny
expect_fail 5 'not a model of family "llama"' -- \
  "$ucp" extract "$data/megatron_tp2_pp1_dp2_bf16" "$work/out" --model llama-tiny
# Planner errors state DeepSpeed's own layout (dp=2,zero=1), not the view it is planned in
# (dp=1,zero=0; issue 15 #8).
expect_fail 5 "target layout tp=3,pp=1,dp=2,sp=1,ep=1,zero=1;" -- \
  "$ucp" convert "$data/megatron_tp2_pp1_dp2_bf16" "$work/out" --layout tp=3
! grep -q "zero=0" "$work/err" || { echo "the error names the internal view:"; cat "$work/err"; exit 1; }
expect_fail 3 "--model applies to DeepSpeed checkpoints" -- \
  "$ucp" verify "$work/megatron_tp2_pp1_dp2_bf16" --model gpt-tiny

# --format deepspeed: what it refuses, and an existing output left alone.
u=$work/megatron_tp2_pp1_dp2_bf16
expect_fail 3 "zero=0 has no ZeRO optimizer files" -- \
  "$ucp" reshard "$u" "$work/out" --layout tp=2,zero=0 --format deepspeed
expect_fail 3 "pipeline engine does not run ZeRO-3" -- \
  "$ucp" reshard "$u" "$work/out" --layout tp=2,pp=2,zero=3 --format deepspeed
expect_fail 5 "not divisible by tp=3" -- \
  "$ucp" reshard "$u" "$work/out" --layout tp=3,zero=1 --format deepspeed
expect_fail 3 "cannot express pp=2" -- \
  "$ucp" reshard "$u" "$work/out" --layout pp=2,zero=1 --format deepspeed --naming megatron-gpt
expect_fail 3 "BF16_Optimizer checkpoints need bf16 training at zero=1" -- \
  "$ucp" convert "$data/megatron_tp2_pp2_sp2_fp16_zero1" "$work/out" --layout tp=2,zero=1 \
  --format deepspeed --optimizer bf16
# (An empty folder is accepted since issue 15 #11: docs/cli.md, "Output folder".)
mkdir "$work/out" && echo mine >"$work/out/keep"
set +e
"$ucp" convert "$data/megatron_tp1_pp2_dp2_bf16" "$work/out" --layout tp=1,zero=1 \
  --format deepspeed >/dev/null 2>"$work/err"
rc=$?
set -e
[ "$rc" = 11 ] && grep -q "exists" "$work/err" && [ "$(ls -A "$work/out")" = keep ] ||
  { echo "an existing --format deepspeed output must be refused (exit 11), got $rc"; exit 1; }
rm -r "$work/out"
echo "deepspeed cli: ok"
