#!/usr/bin/env bash
# A corrupt byte in a rank file's HDF5 metadata (its group of links) is refused with exit 6 and
# a clean error, under valgrind: HDF5 1.10 frees uninitialised table entries when an ordered
# listing of a large group fails on corrupt metadata (an invalid free that segfaulted one CI run
# in a few); ucp lists in native order, which builds no such table. Usage: BIN_DIR.
set -euo pipefail
ucp=$1/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*"; exit 1; }
cat >mid.json <<'JSON'
{"name": "gpt-mid", "family": "gpt", "dtype": "bf16",
 "hyper": {"hidden": 256, "layers": 6, "heads": 8, "ffn_hidden": 1024, "vocab": 4000,
           "max_positions": 64, "make_vocab_size_divisible_by": 16, "tied_embeddings": true}}
JSON
"$ucp" generate src --model mid.json --layout tp=2,pp=1,dp=1 --seed 1 >/dev/null
f=$(ls src/*.h5 | tail -1)
size=$(stat -c %s "$f")
# The last 4 KiB hold the file's dense link storage (its fractal heap and name index).
printf '\x55' | dd of="$f" bs=1 seek=$((size - 4096)) conv=notrunc status=none
set +e
valgrind -q --error-exitcode=99 "$ucp" convert src out --layout tp=1,pp=2 --threads 1 \
  >/dev/null 2>err.txt
rc=$?
set -e
[ "$rc" = 6 ] || { cat err.txt; fail "exit $rc, not 6 (99: valgrind found errors)"; }
grep -q "rank_00001.h5.*metadata checksum.*\[data_loss\]" err.txt || { cat err.txt; fail "message"; }
[ ! -e out ] || fail "output left"
echo "corrupt HDF5 link metadata: exit 6, valgrind clean: $(grep -o 'cannot list the objects.*' err.txt | cut -c1-90)..."
