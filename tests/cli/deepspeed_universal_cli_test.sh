#!/usr/bin/env bash
# DeepSpeed's universal layout read back (issue 15 #5): what `--format deepspeed-universal`
# writes goes through inspect / verify / diff / extract / convert, and comes back bitwise:
#   ucp (generated gpt-tiny at tp=2) -> extract -> deepspeed-universal -> ucp diff equal, extract
#   back -> diff equal, convert to ucp / deepspeed / deepspeed-universal again -> diff equal;
#   a Megatron fixture's universal folder whose model-state files are the fixture's (Megatron
#   args, no recorded model) read without --model, equal to the fixture's extraction;
#   llama-tiny (GQA, SwiGLU) written with the keys DeepSpeed's loader cuts by (SwiGLU as
#   param_n_sub_params 2) and read back bitwise; mixtral-tiny written at ep=1 and refused at ep=2;
#   the ZeRO-3 layout of a current ds_to_universal (zero_pp_rank model states, flat states) read;
# and each bad folder (truncated or corrupt .pt, missing parameter folder or state file, a state
# of the wrong shape) is one error line with its exit code (docs/errors.md) and no output.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

"$ucp" generate g --model gpt-tiny --layout tp=2,pp=1,dp=1 --seed 3 >/dev/null
"$ucp" extract g g.u >/dev/null
"$ucp" reshard g.u dsu --layout tp=2,pp=1 --format deepspeed-universal >/dev/null
"$ucp" inspect dsu >inspect.txt
grep -q "^format: *deepspeed-universal$" inspect.txt
grep -q "^model: *gpt-tiny (rule set gpt, bf16)$" inspect.txt
"$ucp" inspect dsu --json | /usr/bin/python3 -c '
import json, sys
j = json.load(sys.stdin)
assert j["format"] == "deepspeed-universal" and j["layout"] == "universal", j
assert j["source_framework"] == "megatron-deepspeed", j'
"$ucp" verify dsu | grep -q "^ok: dsu (deepspeed-universal, universal, 52 parameters)"
"$ucp" diff dsu g.u | grep -q "^equal: 208 parameter states"
"$ucp" diff g dsu | grep -q "^equal: 208 parameter states"
"$ucp" extract dsu back.u >/dev/null
"$ucp" diff back.u g.u | grep -q "^equal: "
# The extraction's files hold what the original's hold, dataset by dataset (h5py).
# states.load(folder): {parameter: {state: bytes}} of a universal folder, for both checks below.
cat >states.py <<'PY'
import json, h5py
def load(d):
    m = json.load(open(d + "/manifest.json"))
    out = {}
    for p in m["params"]:
        with h5py.File(d + "/" + p["file"], "r") as f:
            out[p["name"]] = {s["name"]: f[s["name"]][()].tobytes() for s in p["states"]}
    return out
PY
PYTHONPATH=$work /usr/bin/python3 - g.u back.u <<'PY'
import sys
from states import load
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a == b, sorted(k for k in a if a[k] != b.get(k))
print("ucp -> deepspeed-universal -> ucp:", len(a), "parameters x", len(next(iter(a.values()))),
      "states bitwise")
PY
"$ucp" convert dsu c --format ucp --layout tp=4,pp=2 >/dev/null
"$ucp" diff c g | grep -q "^equal: "
"$ucp" convert dsu ds --format deepspeed --layout tp=2,pp=1,dp=2,zero=1 >/dev/null
"$ucp" diff ds g | grep -q "^equal: "
"$ucp" convert dsu dsu2 --format deepspeed-universal >/dev/null
"$ucp" diff dsu2 g.u | grep -q "^equal: "
echo "gpt-tiny: ucp -> deepspeed-universal -> inspect, verify, diff, extract, convert: ok"

# A universal folder carrying a Megatron fixture's model-state files: the model comes from their
# args and the tensors' shapes.
fixture=$src/tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16
"$ucp" extract "$fixture" m.u >/dev/null
"$ucp" reshard m.u m.dsu --layout tp=2,pp=1 --format deepspeed-universal \
  --model-states-from "$fixture" >/dev/null
"$ucp" inspect m.dsu | grep -q "model from Megatron args and shapes"
"$ucp" diff m.dsu m.u | grep -q "^equal: "
"$ucp" diff m.dsu "$fixture" | grep -q "^equal: "
echo "megatron fixture: universal folder with its args read without --model: ok"

# LLaMA-style (GQA: 8 heads, 4 query groups; SwiGLU; untied): SwiGLU's [gate; up] goes out as
# DeepSpeed's two sub-parameters, the per-group QKV and the rest as Megatron-DeepSpeed's
# ds_to_universal writes them, and everything comes back bitwise.
"$ucp" generate l --model llama-tiny --layout tp=2,pp=1,dp=1 --seed 4 >/dev/null
"$ucp" extract l l.u >/dev/null
"$ucp" reshard l.u l.dsu --layout tp=2,pp=1 --format deepspeed-universal >/dev/null
"$ucp" diff l.dsu l.u | grep -q "^equal: "
"$ucp" extract l.dsu l.back >/dev/null
PYTHONPATH=$work /usr/bin/python3 - l.u l.back l.dsu <<'PY'
import os, sys, torch
from states import load
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a == b, sorted(k for k in a if a[k] != b.get(k))
# The keys DeepSpeed's load_hp_checkpoint_state cuts by (GPTModelPipe names, 4 layers).
want = {"1.word_embeddings.weight": {"cat_dim": 0, "vocab_tensor": True},
        "7.lm_head.weight": {"cat_dim": 0, "vocab_tensor": True},
        "2.input_layernorm.weight": {}, "6.weight": {},
        "2.self_attention.query_key_value.weight": {"cat_dim": 0},
        "3.self_attention.dense.weight": {"cat_dim": 1},
        "4.mlp.dense_4h_to_h.weight": {"cat_dim": 1},
        "5.mlp.dense_h_to_4h.weight": {"cat_dim": 0, "param_n_sub_params": 2}}
for name, keys in want.items():
    for s in ("fp32", "exp_avg", "exp_avg_sq"):
        d = torch.load(os.path.join(sys.argv[3], "zero", name, s + ".pt"))
        got = {k: v for k, v in d.items() if k != "param"}
        assert got == keys, (name, s, got, keys)
print("llama-tiny: ucp -> deepspeed-universal -> ucp:", len(a), "parameters bitwise; SwiGLU as",
      "param_n_sub_params 2")
PY
"$ucp" convert l.dsu l.ds --format deepspeed --layout tp=4,pp=1,dp=2,zero=1 >/dev/null
"$ucp" diff l.ds l | grep -q "^equal: "
echo "llama-tiny: deepspeed-universal written and read back: ok"

# expect_fail CODE TEXT -- COMMAND...: exit CODE, one stderr line holding TEXT, no output folder.
expect_fail() {
  local code=$1 text=$2
  shift 3
  set +e
  "$@" >/dev/null 2>err
  local got=$?
  set -e
  if [ "$got" != "$code" ] || ! grep -qF -- "$text" err || [ "$(wc -l <err)" != 1 ]; then
    echo "expected exit $code and \"$text\" from: $*"; echo "got exit $got:"; cat err; exit 1
  fi
  [ ! -e out ] || { echo "output left behind by: $*"; exit 1; }
}
bad() { rm -rf bad; cp -r dsu bad; }
p=bad/zero/3.self_attention.query_key_value.weight

bad
f=$p/fp32.pt
truncate -s $(($(stat -c %s "$f") / 2)) "$f"
expect_fail 6 "$f" -- "$ucp" extract bad out
expect_fail 6 'parameter "layers.1.self_attention.query_key_value.weight", state fp32' -- \
  "$ucp" inspect bad

bad
f=$p/exp_avg.pt
off=$(/usr/bin/python3 -c 'import struct, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
i = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
raw = open(sys.argv[1], "rb").read()
n, m = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
print(i.header_offset + 30 + n + m + 8)  # a byte inside the tensor data' "$f")
printf '\x7f' | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
expect_fail 6 "crc32 mismatch" -- "$ucp" verify bad
expect_fail 6 "exp_avg.pt" -- "$ucp" convert bad out --format ucp --layout tp=1

bad
rm -r "$p"
expect_fail 4 "bad/zero/3.self_attention.query_key_value.weight: missing" -- \
  "$ucp" convert bad out --format ucp --layout tp=1
bad
rm "$p/exp_avg_sq.pt"
expect_fail 4 "$p/exp_avg_sq.pt: missing" -- "$ucp" verify bad
bad
cp bad/zero/3.self_attention.dense.weight/exp_avg.pt "$p/exp_avg.pt"
expect_fail 6 "'param' shape [64, 64] differs from fp32.pt's [192, 64]" -- "$ucp" diff bad g.u
bad
rm bad/mp_rank_00_model_states.pt
expect_fail 4 "mp_rank_00_model_states.pt: missing" -- "$ucp" inspect bad
# An optimizer without Adam's moments (the SGD fixture) has no place in the layout: exit 7
# naming the states, nothing written.
expect_fail 7 "states [momentum_buffer]) has no exp_avg" -- \
  "$ucp" convert "$src/tests/data/deepspeed/megatron_sgd_tp2_pp1_dp2_fp16_zero2" sgd.u \
  --format deepspeed-universal
[ -z "$(ls -d sgd.u* 2>/dev/null)" ] || { echo "SGD to deepspeed-universal left output"; exit 1; }
# MoE: experts written as ordinary parameters (ep=1, DeepSpeed's loader cuts tp only) and read
# back; at ep=2 refused, exit 7 naming the missing piece, nothing written.
"$ucp" generate x --model mixtral-tiny --layout tp=2,pp=1,dp=1 --seed 2 >/dev/null
"$ucp" extract x x.u >/dev/null
"$ucp" reshard x.u x.dsu --layout tp=2,pp=1,dp=1 --format deepspeed-universal >/dev/null
"$ucp" diff x.dsu x.u | grep -q "^equal: "
expect_fail 7 "is an expert at ep=2: DeepSpeed's universal loader (0.14.4) cuts tp only" -- \
  "$ucp" reshard x.u out --layout tp=1,pp=1,dp=2,ep=2 --format deepspeed-universal

# ds_to_universal's ZeRO-3 layout (DeepSpeed >= 0.14.5), made from ucp's own tp=1 folder with
# Debian's torch: the model states under ZeRO-3's name with param_shapes (no mp_rank_00), each
# state a bare flat tensor, no step.pt (the step in optimizer_state.pt's Adam state). Read back
# equal, its step the Adam state's; a flat state of the wrong size, a missing grid rank and a bare
# state at tp=2 are refused.
"$ucp" generate z --model gpt-tiny --layout tp=1,pp=1,dp=1 --seed 5 >/dev/null
"$ucp" extract z z.u >/dev/null
"$ucp" reshard z.u z.dsu --layout tp=1,pp=1 --format deepspeed-universal >/dev/null
/usr/bin/python3 - z.dsu <<'PY'
import collections, glob, os, sys, torch
d = sys.argv[1]
mp = torch.load(f"{d}/mp_rank_00_model_states.pt")
shapes = collections.OrderedDict()
for p in sorted(glob.glob(f"{d}/zero/*/")):
    name = os.path.basename(os.path.dirname(p))
    for s in ("fp32", "exp_avg", "exp_avg_sq"):
        t = torch.load(f"{p}{s}.pt")["param"]
        shapes[name] = t.shape
        torch.save(t.detach().clone().flatten(), f"{p}{s}.pt")
    os.remove(f"{p}step.pt")
mp.pop("iteration", None)
mp.update(param_shapes=[shapes], dp_world_size=1, mp_world_size=1, global_steps=0)
torch.save(mp, f"{d}/zero_pp_rank_0_mp_rank_00_model_states.pt")
os.remove(f"{d}/mp_rank_00_model_states.pt")
opt = torch.load(f"{d}/zero/optimizer_state.pt")
# Two sub-groups, one step (9: not the model states' global_steps 0 nor the source's).
opt["optimizer_state_dict"] = {
    "state": {0: {"step": torch.tensor(9.0)}, 1: {"step": torch.tensor(9.0)}},
    "param_groups": opt.get("param_groups", [])}
torch.save(opt, f"{d}/zero/optimizer_state.pt")
PY
"$ucp" diff z.dsu z.u | grep -q "^equal: "
"$ucp" inspect z.dsu | grep -q "ZeRO-3 model-state files (shapes from param_shapes)"
"$ucp" inspect z.dsu | grep -q "^step: *9$"
"$ucp" extract z.dsu z.back >/dev/null
"$ucp" diff z.back z.u | grep -q "^equal: "
expect_rc() {  # rc, folder, what the message names
  local rc=0
  "$ucp" inspect "$2" >/dev/null 2>err.txt || rc=$?
  [ "$rc" = "$1" ] || { echo "rc $rc, not $1, for $2: $(cat err.txt)" >&2; exit 1; }
  grep -q -- "$3" err.txt || { echo "no '$3' in: $(cat err.txt)" >&2; exit 1; }
}
cp -r z.dsu z.short
/usr/bin/python3 -c 'import sys, torch; p = sys.argv[1]; torch.save(torch.load(p)[:-1].clone(), p)' \
  z.short/zero/6.weight/exp_avg.pt
expect_rc 6 z.short 'param_shapes\["6.weight"\] is \[64\]'
# set_key KEY VALUE FILE: one key of a pickled dict set to an integer.
set_key() {
  /usr/bin/python3 -c '
import sys, torch
k, v, p = sys.argv[1:]
m = torch.load(p)
m[k] = int(v)
torch.save(m, p)' "$@"
}
cp -r z.dsu z.grid
set_key dp_world_size 2 z.grid/zero_pp_rank_0_mp_rank_00_model_states.pt
expect_rc 4 z.grid 'zero_pp_rank_1_mp_rank_00_model_states.pt: missing'
cp -r z.dsu z.tp2
cp z.tp2/zero_pp_rank_0_mp_rank_00_model_states.pt z.tp2/zero_pp_rank_0_mp_rank_01_model_states.pt
set_key mp_world_size 2 z.tp2/zero_pp_rank_0_mp_rank_00_model_states.pt
expect_rc 7 z.tp2 'a bare tensor in a ZeRO-3 folder of tp=2'
echo "ZeRO-3 ds_to_universal layout (zero_pp_rank model states, flat states): read back: ok"

echo "deepspeed-universal cli: ok"
