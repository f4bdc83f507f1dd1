#!/usr/bin/env bash
# Issue 14, one read of the source: `extract`, `convert` and `--format` conversions check the
# source's checksums from the bytes they read anyway (io/read_verifier.h), and still refuse a
# corrupt source whether or not the plan needs the corrupt byte: exit 6 (data_loss,
# docs/errors.md), one line naming the file and record, no output left.
#   read:    a byte inside a partition the plan reads (the read that completes it fails);
#   unread:  a byte no read of the plan returns (ZeRO-3 partition padding, a step counter, the
#            Adam states an fp32-only HF export skips): first shown to be unneeded (the same run
#            with --skip-checksums writes exactly what the clean source gives), then refused.
set -euo pipefail
bin=$1 src=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
data=$src/tests/data/deepspeed

# flip FILE RECORD WHERE: xors one byte of zip record data/RECORD of FILE; WHERE is "mid" or
# "last" (its last byte).
flip() {
  /usr/bin/python3 - "$@" <<'PY'
import struct, sys, zipfile
path, record, where = sys.argv[1], sys.argv[2], sys.argv[3]
z = zipfile.ZipFile(path)
i = next(i for i in z.infolist() if i.filename.endswith("/data/" + record))
raw = bytearray(open(path, "rb").read())
n, m = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
at = i.header_offset + 30 + n + m + (i.file_size - 1 if where == "last" else i.file_size // 2)
raw[at] ^= 0xFF
open(path, "wb").write(raw)
PY
}
# bad FIXTURE: a fresh copy of a fixture at $work/bad; prints its tag folder.
bad() { rm -rf "$work/bad"; cp -r "$data/$1" "$work/bad"; echo "$work/bad/global_step7"; }
# refused TEXT -- COMMAND...: exit 6, one stderr line holding TEXT, no $work/out.
refused() {
  local text=$1
  shift 2
  set +e
  "$@" >/dev/null 2>"$work/err"
  local got=$?
  set -e
  if [ "$got" != 6 ] || ! grep -qF -- "$text" "$work/err" || [ "$(wc -l <"$work/err")" != 1 ]; then
    echo "expected exit 6 and \"$text\" from: $*"; echo "got exit $got:"; cat "$work/err"; exit 1
  fi
  [ ! -e "$work/out" ] || { echo "output left behind by: $*"; exit 1; }
  echo "refused (exit 6): $(cat "$work/err")"
}

# A byte the plan reads.
b=$(bad megatron_tp2_pp1_dp2_bf16)
flip "$b/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" 1 mid
refused "crc32 mismatch in record 'data/1' of $b/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" \
  -- "$ucp" extract "$work/bad" "$work/out"
refused "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" -- \
  "$ucp" convert "$work/bad" "$work/out" --layout tp=1
refused "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" -- \
  "$ucp" convert "$work/bad" "$work/out" --layout tp=1,zero=1 --format deepspeed
b=$(bad megatron_tp2_pp2_sp2_fp16_zero1)
flip "$b/layer_03-model_01-model_states.pt" 0 mid  # a module weight (the model state)
refused "crc32 mismatch in record 'data/0' of $b/layer_03-model_01-model_states.pt" -- \
  "$ucp" extract "$work/bad" "$work/out"

# Bytes the plan does not need.
"$ucp" extract "$data/megatron_llama_zero3_tp2_dp3_bf16" "$work/clean3" >/dev/null
b=$(bad megatron_llama_zero3_tp2_dp3_bf16)
flip "$b/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" 16 last  # a partition's padding
"$ucp" extract "$work/bad" "$work/skip" --skip-checksums >/dev/null
"$ucp" diff "$work/clean3" "$work/skip" >/dev/null ||
  { echo "the padding byte is needed by the plan: not the case under test"; exit 1; }
refused "crc32 mismatch in record 'data/16' of $b/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" \
  -- "$ucp" extract "$work/bad" "$work/out"

"$ucp" extract "$data/megatron_tp2_pp1_dp2_bf16" "$work/clean" >/dev/null
b=$(bad megatron_tp2_pp1_dp2_bf16)
flip "$b/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" 3 mid  # a record no view tensor reads
rm -rf "$work/skip"
"$ucp" extract "$work/bad" "$work/skip" --skip-checksums >/dev/null
"$ucp" diff "$work/clean" "$work/skip" >/dev/null ||
  { echo "record data/3 is read by the plan: not the case under test"; exit 1; }
refused "crc32 mismatch in record 'data/3' of $b/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" \
  -- "$ucp" extract "$work/bad" "$work/out"

# A replicated weight (a layernorm on both TP ranks) that the plan compares before its record
# is complete: the checksum failure is what is reported, as it names the file and record.
b=$(bad megatron_tp2_pp1_dp2_bf16)
flip "$b/mp_rank_00_model_states.pt" 2 mid
refused "crc32 mismatch in record 'data/2' of $b/mp_rank_00_model_states.pt" -- \
  "$ucp" extract "$work/bad" "$work/out"

# An HF export reads the fp32 weights only: a corrupt Adam state is refused all the same.
"$ucp" convert "$data/megatron_tp2_pp1_dp2_bf16" "$work/clean_hf" --format hf >/dev/null
b=$(bad megatron_tp2_pp1_dp2_bf16)
flip "$b/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" 6 mid
rm -rf "$work/skip"
"$ucp" convert "$work/bad" "$work/skip" --format hf --skip-checksums >/dev/null
for f in "$work/clean_hf"/*; do
  cmp -s "$f" "$work/skip/$(basename "$f")" ||
    { echo "record data/6 is read by the HF export: not the case under test"; exit 1; }
done
refused "crc32 mismatch in record 'data/6' of $b/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" \
  -- "$ucp" convert "$work/bad" "$work/out" --format hf
# A ucp universal source: each dataset's XXH3 is computed from the ranges the conversion reads,
# in order. A corrupt byte in an fp32 dataset a conversion reads, and one in an exp_avg dataset
# that an fp32-only HF export never reads, are both refused.
"$ucp" generate --model gpt-tiny --layout universal --out "$work/u" --quiet
# uflip STATE: xors the middle byte of dataset STATE of the first parameter file of $work/ubad.
uflip() {
  rm -rf "$work/ubad"
  cp -r "$work/u" "$work/ubad"
  /usr/bin/python3 - "$work/ubad" "$1" <<'PY'
import json, sys, h5py
d, state = sys.argv[1], sys.argv[2]
p = json.load(open(d + "/manifest.json"))["params"][0]
with h5py.File(d + "/" + p["file"], "r") as h:
    ds = h[state]
    at = ds.id.get_offset() + ds.id.get_storage_size() // 2
raw = bytearray(open(d + "/" + p["file"], "rb").read())
raw[at] ^= 0xFF
open(d + "/" + p["file"], "wb").write(raw)
print(p["name"])
PY
}
name=$(uflip fp32)
refused "parameter '$name', state 'fp32': field checksum" -- \
  "$ucp" convert "$work/ubad" "$work/out" --layout tp=2,pp=2
name=$(uflip exp_avg)
"$ucp" convert "$work/u" "$work/u_hf" --format hf >/dev/null
"$ucp" convert "$work/ubad" "$work/skip_hf" --format hf --skip-checksums >/dev/null
for f in "$work/u_hf"/*; do
  cmp -s "$f" "$work/skip_hf/$(basename "$f")" ||
    { echo "exp_avg is read by the HF export: not the case under test"; exit 1; }
done
refused "parameter '$name', state 'exp_avg': field checksum" -- \
  "$ucp" convert "$work/ubad" "$work/out" --format hf
echo "one read cli: ok"
