#!/usr/bin/env bash
# Issue 14 under mpirun: each process checks the CRC-32s of its share of a DeepSpeed source's
# records from its own reads plus what it did not read, and the job agrees before the commit.
# A clean source extracts under 2 and 3 processes to what one process writes; a corrupt byte the
# plan does not need (ZeRO-3 partition padding) fails the job with exit 6 and no output.
set -euo pipefail
bin=$1 src=$2
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none \
  OMPI_MCA_hwloc_base_binding_policy=none
fx=$src/tests/data/deepspeed/megatron_llama_zero3_tp2_dp3_bf16
"$ucp" extract "$fx" "$work/one" >/dev/null
for n in 2 3; do
  mpirun -np "$n" "$ucp" extract "$fx" "$work/np$n" >/dev/null
  "$ucp" diff "$work/one" "$work/np$n" >/dev/null
  echo "extract under $n processes: equal to one process"
done
cp -r "$fx" "$work/bad"
f=$work/bad/global_step7/bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt
/usr/bin/python3 - "$f" <<'PY'
import struct, sys, zipfile
path = sys.argv[1]
i = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith("/data/16"))
raw = bytearray(open(path, "rb").read())
n, m = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
raw[i.header_offset + 30 + n + m + i.file_size - 1] ^= 0xFF  # the partition's padding
open(path, "wb").write(raw)
PY
for n in 2 3; do
  set +e
  mpirun -np "$n" "$ucp" extract "$work/bad" "$work/out" >/dev/null 2>"$work/err"
  rc=$?
  set -e
  [ "$rc" = 6 ] && grep -q "crc32 mismatch in record 'data/16' of .*bf16_zero_pp_rank_1_mp_rank_01" "$work/err" ||
    { echo "expected exit 6 and the record under $n processes, got $rc:"; cat "$work/err"; exit 1; }
  [ ! -e "$work/out" ] || { echo "output left behind under $n processes"; exit 1; }
  echo "corrupt padding under $n processes: refused (exit 6), no output"
done
echo "one read mpi: ok"
