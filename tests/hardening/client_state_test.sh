#!/usr/bin/env bash
# Issue 16 #6 through `ucp`: DeepSpeed client state JSON cannot hold as text (a str with a lone
# surrogate, a Python 2 byte string, bytes, keys that need escaping) is carried losslessly into a
# universal checkpoint and back into DeepSpeed files; a NaN learning rate is refused alike by
# every command; a pickled deepspeed.* callable (which ucp reads as an inert object) is not
# written into a DeepSpeed output, where torch.load would call it. Usage: BIN_DIR SOURCE_ROOT. Needs Debian's torch (/usr/bin/python3).
set -uo pipefail
ucp=$1/ucp
root=$2
py=/usr/bin/python3
fixture="$root/tests/hardening/client_state_fixture.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }

cp -r "$root/tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16" ds
$py "$fixture" strings ds/global_step7 >want.txt || exit 1
"$ucp" extract ds univ >out.txt 2>err.txt
check "extract of non-UTF-8 client state exits 0" '[ $? = 0 ] || { cat err.txt; false; }'
check "the manifest holds the escapes" \
  'grep -q "\"py/str\"" univ/manifest.json && grep -q "\"py/bytes\"" univ/manifest.json'
# ucp -> DeepSpeed from the universal checkpoint (the JSON path) and from the folder (pickles).
"$ucp" convert univ ds_from_json --format deepspeed --layout tp=2,pp=1,dp=2,zero=1 >/dev/null 2>err.txt
check "universal -> deepspeed exits 0" '[ $? = 0 ] || { cat err.txt; false; }'
"$ucp" convert ds ds_from_ds --format deepspeed --layout tp=1,pp=1,dp=1,zero=1 >/dev/null 2>err.txt
check "deepspeed -> deepspeed exits 0" '[ $? = 0 ] || { cat err.txt; false; }'
for out in ds_from_json ds_from_ds; do
  f=$(find "$out" -name mp_rank_00_model_states.pt | head -1)
  $py "$fixture" check "$f" >got.txt 2>err.txt
  check "$out: torch.load gives back every value exactly" 'diff want.txt got.txt'
done

cp -r "$root/tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16" nan
$py "$fixture" nan nan/global_step7 || exit 1
for cmd in "inspect nan" "verify nan" "extract nan x1" "convert nan x2 --format ucp --layout tp=1,pp=1,dp=1"; do
  # shellcheck disable=SC2086
  "$ucp" $cmd >/dev/null 2>err.txt
  code=$?
  check "ucp $cmd refuses the NaN lr with exit 6 naming the field" \
    '[ $code = 6 ] && grep -q "param_groups\[0\].lr is nan" err.txt || { echo "exit $code: $(cat err.txt)"; false; }'
done
cp -r "$root/tests/data/deepspeed/megatron_tp2_pp1_dp2_bf16" evil
$py "$fixture" callable evil/global_step7 || exit 1
"$ucp" extract evil evil_univ >/dev/null 2>err.txt
check "a deepspeed.* callable in the args is read as inert (extract exits 0)" \
  '[ $? = 0 ] || { cat err.txt; false; }'
"$ucp" convert evil evil_out --format deepspeed --layout tp=1,pp=1,dp=1,zero=1 >/dev/null 2>err.txt
code=$?
check "--format deepspeed refuses to write it: exit 7 naming the global, no output" \
  '[ $code = 7 ] && grep -q "deepspeed.evil.run" err.txt && [ ! -e evil_out ] || { echo "exit $code: $(cat err.txt)"; false; }'
exit $fail
