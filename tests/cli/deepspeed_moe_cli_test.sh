#!/usr/bin/env bash
# DeepSpeed-MoE through the CLI (issue 14): the checkpoint the real DeepSpeed 0.14.4 engine wrote
# with 4 experts per MoE layer at ep=2, dp=4 (tests/data/deepspeed/deepspeed_moe_*, made by
# tests/peer/ds_moe_peer.py fixture) is verified, extracted equal to the engine's state
# (expected_moe.pt, compared with real torch and h5py), converted to ucp layouts at other ep and
# written back as DeepSpeed-MoE at ep=2 and ep=1 (expert files, expp_rank files, expert groups
# over dp / ep), read back bitwise; what --format deepspeed does not write and bad folders exit
# with docs/errors.md's codes and name the file.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$src/tests/data/deepspeed
ck=$data/deepspeed_moe_tp1_pp1_dp4_ep2_fp32_zero1
model=(--model "$data/models/mixtral-plain.json")

"$ucp" inspect "$ck" "${model[@]}" | grep -q '^layout: *tp=1,pp=1,dp=4,sp=1,ep=2,zero=1$'
"$ucp" verify "$ck" "${model[@]}" >/dev/null
"$ucp" extract "$ck" "$work/u" "${model[@]}" >/dev/null
same_as_expected() {  # UNIVERSAL: its fp32 / exp_avg / exp_avg_sq equal expected_moe.pt bitwise
/usr/bin/python3 - "$1" "$data/expected_moe.pt" <<'PY'
import json, os, sys
import h5py, torch
u, expected = sys.argv[1], torch.load(sys.argv[2])
manifest = json.load(open(os.path.join(u, "manifest.json")))
got = {p["name"]: p["file"] for p in manifest["params"]}
assert set(got) == set(expected), sorted(set(got) ^ set(expected))
for name, states in expected.items():
    with h5py.File(os.path.join(u, got[name]), "r") as h:
        for s in ("fp32", "exp_avg", "exp_avg_sq"):
            g = torch.from_numpy(h[s][()])
            assert torch.equal(g.view(torch.int32), states[s].contiguous().view(torch.int32)), (name, s)
experts = [n for n in expected if ".experts." in n]
print(f"extraction == expected_moe.pt bitwise: {len(expected)} parameters, {len(experts)} experts")
PY
}
same_as_expected "$work/u"
"$ucp" convert "$ck" "$work/ucp_ep4" --layout tp=2,pp=2,dp=4,ep=4,zero=1 --format ucp "${model[@]}" >/dev/null
"$ucp" diff "$ck" "$work/ucp_ep4" "${model[@]}" | grep -q '^equal'
"$ucp" convert "$ck" "$work/ds_ep1" --layout dp=2,ep=1 --format deepspeed "${model[@]}" >/dev/null
"$ucp" diff "$ck" "$work/ds_ep1" "${model[@]}" | grep -q '^equal'

expect() {  # CODE TEXT CMD...: the command fails with exit CODE and TEXT in its error line
  local code=$1 text=$2; shift 2
  local rc=0
  "$@" >/dev/null 2>"$work/err" || rc=$?
  if [ "$rc" != "$code" ] || ! grep -qF -- "$text" "$work/err"; then
    echo "expected exit $code with \"$text\" from: $*"; echo "got exit $rc:"; cat "$work/err"; exit 1
  fi
}
# DeepSpeed-MoE written (ep=1 above and ep=2 here): the engine's files, read back bitwise, and
# without --model (the written model states record it).
for f in layer_1_expert_3_mp_rank_00_model_states.pt expp_rank_0_mp_rank_00_optim_states.pt \
         zero_pp_rank_1_mp_rank_00_optim_states.pt; do
  [ -f "$work/ds_ep1/global_step7/$f" ]
done
[ ! -e "$work/ds_ep1/global_step7/expp_rank_1_mp_rank_00_optim_states.pt" ]
"$ucp" convert "$ck" "$work/ds_ep2" --layout dp=2,ep=2 --format deepspeed "${model[@]}" >/dev/null
ls "$work/ds_ep2/global_step7" | sort | tr '\n' ' ' > "$work/files"
grep -qxF "expp_rank_0_mp_rank_00_optim_states.pt expp_rank_1_mp_rank_00_optim_states.pt layer_0_expert_0_mp_rank_00_model_states.pt layer_0_expert_1_mp_rank_00_model_states.pt layer_0_expert_2_mp_rank_00_model_states.pt layer_0_expert_3_mp_rank_00_model_states.pt layer_1_expert_0_mp_rank_00_model_states.pt layer_1_expert_1_mp_rank_00_model_states.pt layer_1_expert_2_mp_rank_00_model_states.pt layer_1_expert_3_mp_rank_00_model_states.pt mp_rank_00_model_states.pt zero_pp_rank_0_mp_rank_00_optim_states.pt zero_pp_rank_1_mp_rank_00_optim_states.pt " "$work/files"
"$ucp" inspect "$work/ds_ep2" | grep -q '^layout: *tp=1,pp=1,dp=2,sp=1,ep=2,zero=1$'
"$ucp" extract "$work/ds_ep2" "$work/u2" >/dev/null
same_as_expected "$work/u2"
# ep=2 -> ep=4 at dp=4 -> ep=1 at dp=2: the files of the direct ep=1 conversion, byte for byte.
"$ucp" convert "$work/ds_ep2" "$work/ds_ep4" --layout dp=4,ep=4 --format deepspeed >/dev/null
"$ucp" convert "$work/ds_ep4" "$work/ds_ep1_again" --layout dp=2,ep=1 --format deepspeed >/dev/null
for f in "$work/ds_ep1/global_step7/"*; do
  cmp "$f" "$work/ds_ep1_again/global_step7/$(basename "$f")"
done
echo "DeepSpeed-MoE written at ep=2, ep=4 and ep=1: read back bitwise, round trip byte for byte"
expect 7 "DeepSpeed-MoE is written at ZeRO-1/2 without pipeline stages" \
  "$ucp" convert "$ck" "$work/ds_pp2" --layout pp=2,dp=2,ep=2 --naming megatron-pipe \
  --format deepspeed "${model[@]}"
[ ! -e "$work/ds_pp2" ]
expect 7 "DeepSpeed-MoE is written at ZeRO-1/2 without pipeline stages" \
  "$ucp" convert "$ck" "$work/ds_z3" --layout dp=2,ep=2,zero=3 --format deepspeed "${model[@]}"
[ ! -e "$work/ds_z3" ]
cp -r "$ck" "$work/missing"
rm "$work/missing/global_step7/layer_1_expert_3_mp_rank_00_model_states.pt"
expect 4 "lacks layer_1_expert_3_mp_rank_00_model_states.pt" \
  "$ucp" extract "$work/missing" "$work/out" "${model[@]}"
cp -r "$ck" "$work/other"
cp "$work/other/global_step7/layer_0_expert_0_mp_rank_00_model_states.pt" \
   "$work/other/global_step7/layer_0_expert_2_mp_rank_00_model_states.pt"
expect 6 "layer_0_expert_2_mp_rank_00_model_states.pt: \"layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.0.linear_fc1.weight\" is not a parameter of expert 2" \
  "$ucp" verify "$work/other" "${model[@]}"
cp -r "$ck" "$work/expp"
rm "$work/expp/global_step7/expp_rank_0_mp_rank_00_optim_states.pt"
expect 4 "lacks expp_rank_0_mp_rank_00_optim_states.pt" \
  "$ucp" inspect "$work/expp" "${model[@]}"
# Without the last one the files say ep=1, which the expert groups' partition counts contradict.
cp -r "$ck" "$work/expp1"
rm "$work/expp1/global_step7/expp_rank_1_mp_rank_00_optim_states.pt"
expect 6 "with the folder's 1 expp_rank_*_mp_rank_*_optim_states.pt files: one is missing" \
  "$ucp" extract "$work/expp1" "$work/out" "${model[@]}"
[ ! -e "$work/out" ]
echo "ok: DeepSpeed-MoE (ep=2, dp=4) read, converted, written at ep=1, 2 and 4, and its bad inputs named"
