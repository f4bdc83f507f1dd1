#!/usr/bin/env bash
# Builds offload/offload/optim/adam_cross_check.cc natively (x86-64: portable, AVX2, AVX-512) and
# for AArch64 (portable, NEON, SVE) with aarch64-linux-gnu-g++, runs the AArch64 binary under
# qemu-aarch64 at SVE vector lengths 128, 256 and 512 bits, and requires every run to print the
# same hashes: the paths agree bitwise across architectures. Exits 77 (skip) without the tools.
# Usage: cross_check.sh SOURCE_ROOT WORK_DIR
set -euo pipefail
root=$1
work=$2
mkdir -p "$work"
opt="$root/offload/offload/optim"
flags=(-std=c++20 -O2 -ffp-contract=off -Wall -Wextra -I"$root/libucp" -I"$root/offload")
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  echo "cross_check: aarch64-linux-gnu-g++ or qemu-aarch64 missing; skipped"
  exit 77
fi
g++ "${flags[@]}" -c "$opt/adam_portable.cc" -o "$work/x86_portable.o"
g++ "${flags[@]}" -mavx2 -mfma -mf16c -c "$opt/adam_avx2.cc" -o "$work/x86_avx2.o"
g++ "${flags[@]}" -mavx512f -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -Wno-maybe-uninitialized \
  -c "$opt/adam_avx512.cc" -o "$work/x86_avx512.o"
g++ "${flags[@]}" "$opt/adam_cross_check.cc" "$work"/x86_*.o -o "$work/cross_check_x86"
aarch64-linux-gnu-g++ "${flags[@]}" -c "$opt/adam_portable.cc" -o "$work/arm_portable.o"
aarch64-linux-gnu-g++ "${flags[@]}" -c "$opt/adam_neon.cc" -o "$work/arm_neon.o"
aarch64-linux-gnu-g++ "${flags[@]}" -march=armv8.2-a+sve -c "$opt/adam_sve.cc" -o "$work/arm_sve.o"
aarch64-linux-gnu-g++ "${flags[@]}" -static "$opt/adam_cross_check.cc" "$work"/arm_*.o \
  -o "$work/cross_check_arm"
"$work/cross_check_x86" > "$work/x86.txt"
for vq in 1 2 4; do
  qemu-aarch64 -cpu max,sve-max-vq=$vq "$work/cross_check_arm" > "$work/arm_vq$vq.txt"
  cmp "$work/x86.txt" "$work/arm_vq$vq.txt"
done
echo "cross_check: x86-64 and aarch64 (sve 128/256/512) agree on $(wc -l < "$work/x86.txt") cases"
