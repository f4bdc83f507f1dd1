#!/usr/bin/env bash
# docs/errors.md, "Which faults produce which code": one fault of each kind sent through `ucp`,
# checking its exit code and that the error is one line naming the code. Usage: BIN_DIR.
# The full-disk fault needs root to mount a tmpfs; without it that case is skipped, saying so.
set -uo pipefail
ucp=$1/ucp
work=$(mktemp -d)
cleanup() { mountpoint -q "$work/full" 2>/dev/null && umount "$work/full"; rm -rf "$work"; }
trap cleanup EXIT
cd "$work" || exit 1
"$ucp" generate --model llama-tiny --layout tp=2,pp=1,dp=1 --out src >/dev/null || exit 1
"$ucp" extract src univ >/dev/null || exit 1
fail=0
expect() {  # expected-exit code-name description -- command...
  local want=$1 name=$2 what=$3
  shift 4
  "$@" >/dev/null 2>err.txt
  local got=$?
  if [ "$got" != "$want" ]; then
    echo "FAIL: $what: exit $got, want $want: $(cat err.txt)"; fail=1; return
  fi
  if [ -n "$name" ]; then
    if [ "$(wc -l <err.txt)" != 1 ] || ! grep -q "\[$name\]$" err.txt; then
      echo "FAIL: $what: not one line ending [$name]: $(cat -A err.txt)"; fail=1; return
    fi
  fi
  echo "ok: $what -> $got"
}

"$ucp" generate --model llama-tiny --layout tp=2,pp=1,dp=1 --seed 7 --out src7 >/dev/null
expect 1 "" "diff of different checkpoints" -- "$ucp" diff src src7
expect 2 "" "unknown option" -- "$ucp" extract --bogus src x
expect 3 invalid_argument "layout above kMaxAxisSize" -- "$ucp" reshard univ x3 --layout dp=70000
expect 4 not_found "missing source" -- "$ucp" extract nonexistent x4
expect 5 failed_precondition "tp not dividing the query groups" -- \
  "$ucp" reshard univ x5 --layout tp=3
cp -r src c6
truncate -s 3000 c6/rank_00000.h5
expect 6 data_loss "truncated rank file" -- "$ucp" verify c6
cp -r univ c7
sed -i 's/"version": 1/"version": 99/' c7/manifest.json
expect 7 unimplemented "manifest format version 99" -- "$ucp" inspect c7
cp -r src c8
rm c8/rank_00000.h5 && mkfifo c8/rank_00000.h5
expect 8 io_error "a FIFO in place of a rank file" -- timeout 20 "$ucp" extract c8 x8
expect 9 resource_exhausted "ulimit -n 10" -- bash -c "ulimit -n 10; exec '$ucp' extract src x9"
# Issue 16 #4: under a low open-file limit, readers size their file caches from it (a 52-file
# universal checkpoint reshards and diffs at ulimit -n 32), a writer raises the soft limit to what
# it needs or says what it needs (exit 9, never "corrupt").
"$ucp" generate g52 --model gpt-tiny --layout tp=1,pp=1,dp=1 >/dev/null && "$ucp" extract g52 g52u >/dev/null
expect 0 "" "reshard of a 52-file universal checkpoint under ulimit -n 32" -- \
  bash -c "ulimit -n 32; exec '$ucp' reshard g52u x32r --layout tp=2,pp=1,dp=1"
expect 0 "" "diff of it under ulimit -n 32" -- bash -c "ulimit -n 32; exec '$ucp' diff g52u g52"
expect 0 "" "extract under a soft ulimit -n 32 (raised to what it needs)" -- \
  bash -c "ulimit -Sn 32; exec '$ucp' extract g52 x32e"
expect 9 resource_exhausted "extract under a hard ulimit -n 32 says what it needs" -- \
  bash -c "ulimit -n 32; exec '$ucp' extract g52 x32h"
grep -q "raise ulimit -n" err.txt || { echo "FAIL: the limit error does not say what it needs"; fail=1; }
expect 11 already_exists "existing destination" -- "$ucp" extract src univ
mkdir full
if mount -t tmpfs -o size=512k tmpfs full 2>/dev/null; then
  # issue 16 #3: used to die by SIGSEGV (139) in HDF5's exit handlers after the io_error line.
  expect 8 io_error "full disk (512 KiB tmpfs)" -- "$ucp" extract src full/out
  [ -z "$(ls -A full)" ] || { echo "FAIL: the full-disk extract left $(ls -A full)"; fail=1; }
else
  echo "skip: full disk: cannot mount a tmpfs (needs root)"
fi
# Errors are one line even for a path with a newline (issue 16 #10).
expect 4 not_found "a path with a newline" -- "$ucp" extract $'no\nsuch' x10
exit $fail
