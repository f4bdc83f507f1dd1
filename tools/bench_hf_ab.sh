#!/usr/bin/env bash
# Two ucp binaries on the same Hugging Face import and export, alternating, for a before/after
# comparison on a shared machine (docs/PERFORMANCE.md "Hugging Face import/export"): user and
# system CPU time are the steadier figures where other work competes for the cores.
# Usage: tools/bench_hf_ab.sh UCP_BEFORE UCP_AFTER HF_DIR WORK_DIR [ROUNDS]
# HF_DIR: e.g. `tools/bench_hf.py make --out HF_DIR` (gpt2-medium's shape, fp32). Each round runs
# BEFORE then AFTER: the import `convert HF ckpt --layout tp=2,pp=2 --format ucp` and the export
# `convert ckpt out --format hf`, each after an unmeasured copy of its source is read, printing
# wall, user and system seconds and the load average at its start.
set -euo pipefail
before=$1 after=$2 hf=$3 work=$4 rounds=${5:-2}
mkdir -p "$work"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%FT%TZ)"
run() {  # label, command...
  local label=$1; shift
  local load
  load=$(cut -d' ' -f1 /proc/loadavg)
  /usr/bin/time -f "%e %U %S" -o "$work/.time" "$@" >/dev/null 2>"$work/.err" ||
    { cat "$work/.err" >&2; exit 1; }
  read -r wall user sys <"$work/.time"
  printf '  %-16s wall %6.2f s  user %6.2f s  sys %6.2f s  cpu %6.2f s  (load %s)\n' \
    "$label" "$wall" "$user" "$sys" "$(echo "$user + $sys" | bc -l)" "$load"
}
for r in $(seq "$rounds"); do
  echo "round $r"
  for which in before after; do
    bin=$before
    [ "$which" = after ] && bin=$after
    rm -rf "$work/ckpt" "$work/out"
    cat "$hf"/*.safetensors >/dev/null
    run "import $which" "$bin" convert "$hf" "$work/ckpt" --layout tp=2,pp=2 --format ucp
    cat "$work"/ckpt/*.h5 >/dev/null 2>&1 || true
    run "export $which" "$bin" convert "$work/ckpt" "$work/out" --format hf
    if [ "$r" = 1 ]; then
      cp -r "$work/out" "$work/out-$which"
    fi
  done
  if [ "$r" = 1 ]; then
    cmp "$work/out-before/model.safetensors" "$work/out-after/model.safetensors"
    echo "  exports of both binaries: byte-identical"
    rm -rf "$work/out-before" "$work/out-after"
  fi
done
rm -rf "$work/ckpt" "$work/out"
