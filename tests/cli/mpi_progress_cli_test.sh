#!/usr/bin/env bash
# The root of an MPI job shows the whole job's progress (issue 15 #4), through the real binary
# with stderr not a terminal (plain lines, UCP_PROGRESS_EVERY=0.2 s so a small run has some):
#  1. `mpirun -np 2 ucp convert`: the root's last "convert" line is 100% of the same total as
#     the single-process run's (the whole job's bytes; each process writes one of the two rank
#     files, so the root's own share is about half);
#  2. the same with `--json`: bytes_written and output_bytes equal the single-process run's;
#  3. one process failing (a corrupt shard) ends both promptly with exit 6 and no output.
# Usage: BIN_DIR.
set -euo pipefail
bin=$1
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_hwloc_base_binding_policy=none
export UCP_PROGRESS_EVERY=0.2
fail() { echo "FAIL: $*"; exit 1; }

# ~90 MiB to convert: long enough for a few lines, short on 2 cores.
cat >mid.json <<'EOF'
{"name": "gpt-mid", "family": "gpt", "dtype": "bf16",
 "hyper": {"hidden": 256, "layers": 6, "heads": 8, "ffn_hidden": 1024, "vocab": 4000,
           "max_positions": 64, "make_vocab_size_divisible_by": 16, "tied_embeddings": true}}
EOF
"$ucp" generate src --model mid.json --layout tp=2,pp=1,dp=1 --seed 1 >/dev/null

last() {  # FILE PHASE: the last plain progress line of PHASE
  { grep "^ucp convert: $2 " "$1" || true; } | tail -1
}
total_of() { sed -n 's/.* of \([0-9.]* [KMGT]*i*B\) (.*/\1/p'; }

"$ucp" convert src one --layout tp=1,pp=2 2>one.err >/dev/null
# (The source's checksums are verified while it streams; the "verify" phase after it is the pass
# over the bytes the conversion did not read, whose size is only known as it goes: no total.)
want=$(last one.err convert | total_of)
[ -n "$want" ] || fail "no convert line with a total from one process: $(cat one.err)"
# (A loaded machine may start the other process's share after the root has finished its own:
# the root's lines then wait for its first report, and say so, rather than end the phase on the
# root's share. ucp-cli/progress_test.cc replays that order of arrival.)
mpirun -np 2 "$ucp" convert src two --layout tp=1,pp=2 2>two.err >/dev/null
got=$(last two.err convert | total_of)
cat two.err
[ "$got" = "$want" ] || fail "root's last convert line shows a total of '$got', the job's is '$want'"
last two.err convert | grep -q "(100%)" || fail "root's last convert line is not 100%: $(last two.err convert)"
[ "$(grep -c . two.err)" = "$(grep -c '^ucp convert: ' two.err)" ] || fail "other lines on stderr"
[ -n "$(last two.err verify)" ] || fail "root shows no verify phase: $(cat two.err)"
echo "root's last lines: $(last two.err verify | cut -d, -f1) | $(last two.err convert | cut -d, -f1)" \
  "= one process's total"

"$ucp" convert src one.j --layout tp=1,pp=2 --json 2>/dev/null >one.json
mpirun -np 2 "$ucp" convert src two.j --layout tp=1,pp=2 --json 2>/dev/null >two.json
/usr/bin/python3 - one.json two.json <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
for k in ("bytes_written",):
    assert a["output"][k] == b["output"][k], (k, a["output"][k], b["output"][k])
assert a["output_bytes"] == b["output_bytes"], (a["output_bytes"], b["output_bytes"])
print("--json under mpirun: bytes_written", b["output"]["bytes_written"], "and output_bytes",
      b["output_bytes"], "are the whole job's")
PY

# A corrupt shard: the process reading it fails, the other stops with it; nothing waits for
# progress reports that will not come.
cp -r src bad
f=$(ls bad/*.h5 | tail -1)
size=$(stat -c %s "$f")
printf '\x55' | dd of="$f" bs=1 seek=$((size - 4096)) conv=notrunc status=none
set +e
timeout 60 mpirun -np 2 "$ucp" convert bad out --layout tp=1,pp=2 >/dev/null 2>bad.err
rc=$?
set -e
[ "$rc" = 6 ] || { cat bad.err; fail "a corrupt shard under mpirun: exit $rc, not 6"; }
[ ! -e out ] || fail "output left behind"
echo "a failing process under mpirun: exit 6 for the job, no output, no hang"

# Formats whose files the processes do not share (hf, deepspeed, deepspeed-universal) are
# written by the root alone, the others waiting for its outcome: the same bytes as one process
# writes, one DST, and the root's progress ends at 100% of its own bytes.
for fmt in hf deepspeed deepspeed-universal; do
  lay=(); [ "$fmt" = deepspeed ] && lay=(--layout tp=1,pp=2,dp=1,zero=1)
  "$ucp" convert src "one.$fmt" --format "$fmt" "${lay[@]}" >/dev/null 2>&1
  timeout 120 mpirun -np 2 "$ucp" convert src "two.$fmt" --format "$fmt" "${lay[@]}" >/dev/null \
    2>"two.$fmt.err" || { cat "two.$fmt.err"; fail "--format $fmt under mpirun: exit $?"; }
  diff -r "one.$fmt" "two.$fmt" >/dev/null || fail "--format $fmt under mpirun: not one process's bytes"
  [ -z "$(ls -d two."$fmt".tmp-* 2>/dev/null)" ] || fail "--format $fmt under mpirun left a temporary"
  if grep -q "^ucp convert: convert .* of " "two.$fmt.err"; then
    last "two.$fmt.err" convert | grep -q "(100%)" ||
      fail "--format $fmt under mpirun: last convert line $(last "two.$fmt.err" convert)"
  fi
done
echo "--format hf / deepspeed / deepspeed-universal under mpirun: the root writes, the same bytes as one process"
echo "mpi progress cli: ok"
