#!/usr/bin/env bash
# A DeepSpeed PipelineModule whose topology has no `model` axis (PipeDataParallelTopology, what
# PipelineModule(num_stages=P) builds) names its layer files layer_XX-model_states.pt, without
# the tp rank (pipe/module.py ckpt_layer_path: get_rank_repr omits the pipe and data axes). ucp
# reads such a folder as tp=1, pp = the mp_rank files (not as tp = the mp_rank files), equal to
# the same checkpoint with Megatron's layer_XX-model_00 names; a folder mixing the two forms is
# refused with exit 6 naming it.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ck=$src/tests/data/deepspeed/megatron_tp1_pp2_dp2_bf16
cp -r "$ck" "$work/nomodel"
for f in "$work"/nomodel/global_step7/layer_*-model_00-model_states.pt; do
  mv "$f" "${f/-model_00-model_states.pt/-model_states.pt}"
done
ls "$work/nomodel/global_step7" | grep -qx 'layer_01-model_states.pt'
"$ucp" inspect "$work/nomodel" | grep -q '^layout: *tp=1,pp=2,dp=2,sp=1,ep=1,zero=1$'
"$ucp" diff "$ck" "$work/nomodel" | grep -q '^equal'
"$ucp" verify "$work/nomodel" >/dev/null
cp -r "$work/nomodel" "$work/mixed"
cp "$ck/global_step7/layer_02-model_00-model_states.pt" "$work/mixed/global_step7/"
rc=0
"$ucp" inspect "$work/mixed" >/dev/null 2>"$work/err" || rc=$?
if [ "$rc" != 6 ] || ! grep -qF "mixes layer_XX-model_TT-model_states.pt and layer_XX-model_states.pt" "$work/err"; then
  echo "expected exit 6 naming the mixed layer files, got $rc:"; cat "$work/err"; exit 1
fi
echo "ok: layer_XX-model_states.pt (no model axis) read as tp=1,pp=2, equal to the tp-named files"
