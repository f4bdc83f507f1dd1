#!/usr/bin/env bash
# Issue 15 through the real `ucp` binary, one section per point of the issue:
#   3  omitted --layout keys and --format keep the source's (DeepSpeed in -> DeepSpeed out, dp and
#      zero kept), said in the summary; --format overrides;
#   5  convert reads every source and writes every format; reshard / extract are shorthands that
#      refuse nothing convert does (a DeepSpeed folder reshards; deepspeed-universal from any source);
#   6  help: `ucp help CMD`, `ucp CMD -h`, `ucp CMD help`, usage like git's with examples, "missing
#      SRC", -V, "did you mean";
#   7  --json on every command (one JSON object on stdout, errors included with their exit code);
#      inspect lists what decides the layouts and the values that fit;
#   8  DeepSpeed folders shown at their own layout (dp=2,zero=1) in inspect and verify;
#   9  errors that say what to do (valid tp values, presets, --format deepspeed, the missing file,
#      the same code for a missing rank file of either format);
#   10 generate takes DST positionally (--out still works), --memory-limit 1GB / 1G / 1GiB,
#      options that do nothing refused, --data-dir, every preset in --help;
#   and the bash completion script generated from the command table.
set -euo pipefail
src=$1 bin=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
ds=$src/tests/data/deepspeed/megatron_llama_tp2_pp2_dp2_bf16   # tp=2,pp=2,dp=2, BF16_Optimizer
dsgpt=$src/tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16      # GPT: deepspeed-universal can hold it
fail() { echo "FAIL: $*"; exit 1; }
# json FILE EXPR: evaluates the python expression EXPR over j = the one JSON object in FILE.
json() { /usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert eval(sys.argv[2]), j' "$1" "$2"; }
# expect CODE TEXT -- COMMAND...: exit CODE and TEXT on stderr.
expect() {
  local code=$1 text=$2
  shift 3
  set +e
  "$@" >out.txt 2>err.txt
  local got=$?
  set -e
  [ "$got" = "$code" ] && grep -qF -- "$text" err.txt ||
    { echo "expected exit $code and \"$text\" from: $*"; echo "got $got:"; cat err.txt; exit 1; }
}

# --- 3: defaults from the source -------------------------------------------------------------
"$ucp" convert "$ds" ds_tp1 --layout tp=1 >out.txt
grep -q "^wrote DeepSpeed checkpoint ds_tp1 at tp=1,pp=2,dp=2,sp=1,ep=1,zero=1" out.txt || fail "3: $(cat out.txt)"
grep -q "format: deepspeed (the source's family" out.txt || fail "3: no format line"
grep -q "layout: tp from --layout, pp,dp,sp,ep,zero kept from the source" out.txt || fail "3: layout line"
[ -f ds_tp1/latest ] || fail "3: DeepSpeed output expected"
"$ucp" inspect ds_tp1 --json >j.json
json j.json 'j["format"] == "deepspeed" and j["layout"] == "tp=1,pp=2,dp=2,sp=1,ep=1,zero=1"'
"$ucp" convert "$ds" ucp_tp1 --layout tp=1 --format ucp >out.txt
grep -q "format: ucp (--format)" out.txt && [ -f ucp_tp1/ucp_layout.json ] || fail "3: --format ucp"
"$ucp" generate g --model gpt-tiny --layout tp=2,pp=1,dp=2,zero=1 --seed 3 >/dev/null
"$ucp" convert g g_tp1 --layout tp=1 --json >j.json
json j.json 'j["output"]["format"] == "ucp" and j["output"]["layout"] == "tp=1,pp=1,dp=2,sp=1,ep=1,zero=1"'
"$ucp" convert g hf --format hf >/dev/null
"$ucp" convert hf hf2 >out.txt   # hf in, hf out
grep -q "format: hf (the source's family" out.txt && [ -f hf2/config.json ] || fail "3: hf -> hf"
expect 3 "holds full tensors; give --format ucp" -- "$ucp" convert hf x --layout tp=2
echo "3: DeepSpeed in -> DeepSpeed out at tp=1,pp=2,dp=2,zero=1; ucp keeps dp=2,zero=1; hf -> hf: ok"

# --- 5: one conversion command, shorthands without refusals ------------------------------------
"$ucp" reshard "$ds" ds_dp1 --layout dp=1 >out.txt
grep -q "^wrote DeepSpeed checkpoint ds_dp1 at tp=2,pp=2,dp=1,sp=1,ep=1,zero=1" out.txt || fail "5: reshard DS"
"$ucp" diff ds_dp1 "$ds" | grep -q "^equal: " || fail "5: reshard DS content"
"$ucp" extract ds_tp1 u >/dev/null
"$ucp" convert u u_tp2 --layout tp=2 >out.txt   # universal in: convert no longer refuses it
grep -q "^wrote u_tp2 at tp=2,pp=1,dp=1" out.txt || fail "5: convert from universal"
"$ucp" diff u_tp2 "$ds" | grep -q "^equal: " || fail "5: universal -> tp=2 content"
"$ucp" convert "$dsgpt" dsu --format deepspeed-universal --layout tp=2 >/dev/null   # DS -> DS universal
[ -f dsu/zero/optimizer_state.pt ] || fail "5: deepspeed-universal from a DeepSpeed folder"
ls -d dsu.tmp-* 2>/dev/null && fail "5: staging folder left behind"
# Read back: every format ucp writes is a source (the fixture's args give the model).
"$ucp" inspect dsu | grep -q "^format: *deepspeed-universal$" || fail "5: inspect deepspeed-universal"
"$ucp" diff dsu "$dsgpt" | grep -q "^equal: " || fail "5: deepspeed-universal read back"
expect 2 "missing --layout" -- "$ucp" reshard u r
echo "5: reshard of a DeepSpeed folder, convert from universal, deepspeed-universal from DeepSpeed and back: ok"

# --- 6: help -----------------------------------------------------------------------------------
for how in "help convert" "convert --help" "convert -h" "convert help"; do
  # shellcheck disable=SC2086
  "$ucp" $how >help.txt || fail "6: ucp $how exit"
  head -1 help.txt | grep -q "^usage: ucp convert SRC DST \[--layout L\]" || fail "6: ucp $how: $(head -1 help.txt)"
  grep -q "^examples:" help.txt || fail "6: no examples in ucp $how"
  ! grep -q -- "--src arg\|--dst arg" help.txt || fail "6: boost's --src arg in ucp $how"
done
for c in convert extract reshard generate inspect verify diff plan; do
  [ "$("$ucp" help $c | grep -c '^  ucp ')" -ge 2 ] || fail "6: fewer than 2 examples for $c"
done
expect 2 "missing SRC" -- "$ucp" convert
expect 2 "missing DST" -- "$ucp" convert "$ds"
expect 2 "missing PATH" -- "$ucp" inspect
expect 2 'did you mean "convert"' -- "$ucp" convrt
expect 2 "did you mean --layout" -- "$ucp" convert "$ds" x --layot tp=1
[ "$("$ucp" -V)" = "$("$ucp" --version)" ] && "$ucp" -V | grep -q "^ucp [0-9]" || fail "6: -V"
echo "6: help CMD / CMD -h / CMD help, examples, missing SRC, did you mean, -V: ok"

# --- 7: --json everywhere -----------------------------------------------------------------------
"$ucp" version --json >j.json && json j.json 'j["ok"] and j["version"]'
"$ucp" inspect "$ds" --json >j.json
json j.json 'j["decides_layouts"]["heads"] == 4 and j["decides_layouts"]["kv_heads"] == 2 and j["decides_layouts"]["layers"] == 2'
json j.json 'j["fitting"]["tp"] == [1, 2, 4] and j["fitting"]["pp"] == [1, 2]'
"$ucp" inspect "$ds" >i.txt
grep -q "^fits: *tp 1, 2, 4; pp 1, 2 (even stages; with stages= any pp up to 2)$" i.txt || fail "7: inspect fits line"
"$ucp" verify "$ds" --json >j.json && json j.json 'j["ok"] and j["source"]["stored_bytes"] > 0'
"$ucp" diff g g_tp1 --json >j.json && json j.json 'j["equal"] and j["parameter_states_compared"] > 0'
"$ucp" generate g2 --model gpt-tiny --layout tp=1 --json >j.json && json j.json 'j["output"]["bytes_written"] > 0'
"$ucp" convert g g3 --layout dp=1 --json >j.json
json j.json 'j["source"]["layout"] == "tp=2,pp=1,dp=2,sp=1,ep=1,zero=1" and j["output"]["tensors"] > 0 and j["elapsed_s"] >= 0'
"$ucp" plan --model gpt-tiny --from tp=2 --to universal --json >j.json && json j.json 'isinstance(j, dict)'
set +e
"$ucp" convert nosuch x --json >j.json 2>/dev/null
rc=$?
set -e
[ "$rc" = 4 ] && json j.json 'not j["ok"] and j["exit_code"] == 4 and j["error"]["code"] == "not_found"' || fail "7: error JSON"
set +e
"$ucp" convert --json >j.json 2>/dev/null
rc=$?
set -e
[ "$rc" = 2 ] && json j.json 'j["exit_code"] == 2 and j["error"]["message"] == "missing SRC"' || fail "7: usage JSON"
echo "7: --json on version, inspect, verify, diff, generate, convert, plan and errors: ok"

# --- 8: DeepSpeed folders at their own layout -----------------------------------------------------
grep -q "^layout: *tp=2,pp=2,dp=2,sp=1,ep=1,zero=1$" i.txt || fail "8: inspect layout"
"$ucp" verify "$ds" | grep -q "tp=2,pp=2,dp=2,sp=1,ep=1,zero=1" || fail "8: verify layout"
echo "8: inspect and verify show tp=2,pp=2,dp=2,zero=1: ok"

# --- 9: errors that say what to do ------------------------------------------------------------------
expect 5 "tp values that fit" -- "$ucp" convert "$ds" x --layout tp=3
grep -q "tp values that fit llama: 1, 2, 4)" err.txt || fail "9: tp list: $(cat err.txt)"
expect 4 "presets in" -- "$ucp" generate x --model nosuch --layout tp=1
grep -q "gpt-tiny, gpt2-medium, gpt2-small, llama-13b, llama-3b, llama-tiny, llama-tiny-tied, mixtral-tiny" err.txt || fail "9: presets"
# (experts at ep > 1: DeepSpeed's universal loader cuts tp only; its ZeRO files hold them)
"$ucp" generate mx --model mixtral-tiny --layout tp=1,dp=2,zero=1 --seed 1 >/dev/null
expect 7 "--format deepspeed writes this model" -- "$ucp" convert mx x --format deepspeed-universal --layout ep=2
cp -r "$ds" dsbad && rm dsbad/global_step7/bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt
expect 4 "bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt" -- "$ucp" verify dsbad
cp -r g gbad && rm gbad/rank_00003.h5
expect 4 "rank_00003.h5 is missing" -- "$ucp" verify gbad
[ "$(grep -o "$work/gbad" err.txt | wc -l)" -le 1 ] || fail "9: path printed twice: $(cat err.txt)"
echo "9: valid tp values, presets, --format deepspeed, missing rank files exit 4 for both formats: ok"

# --- 10: consistent options ------------------------------------------------------------------------
"$ucp" generate --out g_out --model gpt-tiny --layout tp=1 >/dev/null   # the older spelling
"$ucp" diff g2 g_out | grep -q "^equal: " || fail "10: --out alias"
expect 3 "DST given twice" -- "$ucp" generate a --out b --model gpt-tiny --layout tp=1
for m in 1GB 1G 1GiB 512MB; do "$ucp" convert g "m$m" --layout tp=1 --memory-limit $m >/dev/null; done
expect 2 "unknown option --memory-limit" -- "$ucp" verify g --memory-limit 1G
expect 2 "unknown option --skip-checksums" -- "$ucp" diff g g2 --skip-checksums
expect 2 "unknown option --layout" -- "$ucp" extract g x --layout tp=1
mkdir -p data/models && cp "$src/patterns/gpt.json" data/ &&
  sed 's/"name": "gpt-tiny"/"name": "mine"/' "$src/patterns/models/gpt-tiny.json" >data/models/mine.json
"$ucp" generate gm --model mine --layout tp=1 --data-dir data >/dev/null
"$ucp" inspect gm --data-dir data >i.txt
grep -q "^model: *mine" i.txt || fail "10: --data-dir"
expect 4 "presets in data/models: mine" -- "$ucp" plan --model gpt-tiny --from tp=1 --to tp=2 --data-dir data
"$ucp" generate --help >gen_help.txt
"$ucp" convert --help >conv_help.txt
for p in gpt-tiny gpt2-medium gpt2-small llama-13b llama-3b llama-tiny llama-tiny-tied mixtral-tiny; do
  grep -q "$p" gen_help.txt || fail "10: preset $p not in generate --help"
  grep -q "$p" conv_help.txt || fail "10: preset $p not in convert --help"
done
q_out=$("$ucp" generate g_quiet --model gpt-tiny --layout tp=1,pp=1,dp=1 --quiet 2>&1) ||
  fail "10: generate --quiet failed"
[ -z "$q_out" ] || fail "10: generate --quiet printed: $q_out"
q_out=$("$ucp" convert g_quiet g_quiet2 --layout tp=2 --quiet 2>&1) || fail "10: convert --quiet failed"
[ -z "$q_out" ] || fail "10: convert --quiet printed: $q_out"
echo "10: generate DST, --out alias, 1GB/1G/1GiB, refused options, --data-dir, presets in help, --quiet: ok"

# --- completion ----------------------------------------------------------------------------------
"$ucp" completion bash >ucp.bash
bash -c 'source ./ucp.bash
COMP_WORDS=(ucp conv); COMP_CWORD=1; _ucp; [ "${COMPREPLY[*]}" = convert ] || exit 1
COMP_WORDS=(ucp convert --lay); COMP_CWORD=2; _ucp; [ "${COMPREPLY[*]}" = --layout ] || exit 2
COMP_WORDS=(ucp convert a b --format deepspeed-u); COMP_CWORD=5; _ucp
[ "${COMPREPLY[*]}" = deepspeed-universal ] || exit 3' || fail "completion: $?"
echo "completion: commands, options and formats complete: ok"
