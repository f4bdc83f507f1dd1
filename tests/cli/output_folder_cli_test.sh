#!/usr/bin/env bash
# Issue 15 points 2 and 11, through the real binary: ucp writes only inside DST (the
# deepspeed-universal sink included: no latest_universal in DST's parent unless --into-root asks
# for it); an empty pre-created DST is accepted; DST equal to SRC or inside it is refused (exit
# 3); --into-root adds a new tag to an existing DeepSpeed root and updates its `latest` (or
# `latest_universal`) atomically, saying so. Usage: BIN_DIR.
set -euo pipefail
bin=$1
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail=0
expect() {  # CODE LABEL -- COMMAND...: runs COMMAND, checks its exit code, keeps its output
  local want=$1 label=$2 rc=0
  shift 3
  "$@" >out.txt 2>err.txt || rc=$?
  if [ "$rc" != "$want" ]; then
    echo "FAIL: $label: exit $rc, want $want"; cat out.txt err.txt; fail=1
  fi
}
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

"$ucp" generate src --model gpt-tiny --layout tp=2,pp=1,dp=2,zero=1 --seed 1 >/dev/null
sums src >src.sha

# An empty folder made beforehand is filled (atomically: built beside it, renamed over it).
mkdir empty
expect 0 "empty DST" -- "$ucp" convert src empty --layout tp=1
grep -q "placed: the empty folder empty now holds it" out.txt || { echo "FAIL: summary"; cat out.txt; fail=1; }
"$ucp" verify empty >/dev/null || { echo "FAIL: the filled empty folder does not verify"; fail=1; }
! compgen -G "empty.tmp-*" >/dev/null || { echo "FAIL: staging left behind"; fail=1; }
echo "empty DST: $(head -1 out.txt)"
mkdir full && touch full/keep
expect 11 "non-empty DST" -- "$ucp" convert src full --layout tp=1
[ "$(ls full)" = keep ] || { echo "FAIL: non-empty DST touched"; fail=1; }

# DST is SRC or inside it: refused before anything is made.
expect 3 "DST inside SRC" -- "$ucp" convert src src/sub --layout tp=1
grep -q "DST src/sub is inside SRC src" err.txt || { echo "FAIL: message"; cat err.txt; fail=1; }
echo "DST inside SRC: $(cat err.txt)"
expect 3 "DST = SRC" -- "$ucp" convert src ./src/ --layout tp=1
grep -q "is SRC" err.txt || { echo "FAIL: message"; cat err.txt; fail=1; }
expect 3 "DST = SRC by another name" -- "$ucp" convert src "$work/empty/../src" --layout tp=1
cmp -s <(sums src) src.sha || { echo "FAIL: the source changed"; fail=1; }

# deepspeed-universal writes only DST (no latest_universal beside it, no .tmp- sibling left).
"$ucp" extract src univ >/dev/null
mkdir parent
expect 0 "deepspeed-universal" -- "$ucp" reshard univ parent/global_step1_universal \
  --layout tp=1,pp=1,dp=1 --format deepspeed-universal
[ "$(ls -A parent)" = global_step1_universal ] || { echo "FAIL: written beside DST: $(ls -A parent)"; fail=1; }
[ -d parent/global_step1_universal/zero ] || { echo "FAIL: no zero/ in the output"; fail=1; }
echo "deepspeed-universal: parent holds only $(ls -A parent)"

# --into-root: a second tag in a DeepSpeed root, `latest` moved to it.
expect 0 "deepspeed root" -- "$ucp" convert src ds --format deepspeed --layout tp=1
first=$(cat ds/latest)
expect 0 "--into-root" -- "$ucp" convert src ds --format deepspeed --layout tp=2 --tag resharded \
  --into-root
[ "$(cat ds/latest)" = resharded ] || { echo "FAIL: latest is $(cat ds/latest)"; fail=1; }
[ -d "ds/$first" ] && [ -d ds/resharded ] || { echo "FAIL: tags: $(ls ds)"; fail=1; }
grep -q "placed: added tag resharded to DeepSpeed root ds; ds/latest now names it (was $first)" out.txt ||
  { echo "FAIL: summary"; cat out.txt; fail=1; }
! compgen -G "ds/ucp.tmp-*" >/dev/null || { echo "FAIL: staging left in the root"; fail=1; }
"$ucp" inspect ds/resharded >inspect.txt || { echo "FAIL: the new tag does not open"; fail=1; }
grep -q "tp=2" inspect.txt || { echo "FAIL: the new tag is not tp=2"; cat inspect.txt; fail=1; }
echo "--into-root: $(grep placed: out.txt)"
expect 11 "--into-root, tag exists" -- "$ucp" convert src ds --format deepspeed --layout tp=1 \
  --tag resharded --into-root
[ "$(cat ds/latest)" = resharded ] || { echo "FAIL: latest changed by a refused write"; fail=1; }
expect 3 "--into-root with --format ucp" -- "$ucp" convert src ds --format ucp --into-root
expect 4 "--into-root, no root" -- "$ucp" convert src nowhere --format deepspeed --into-root

# --into-root for deepspeed-universal: the tag and latest_universal, in the root only.
mkdir dsu
expect 0 "deepspeed-universal --into-root" -- "$ucp" reshard univ dsu --layout tp=1,pp=1,dp=1 \
  --format deepspeed-universal --into-root
tag=$(cat dsu/latest_universal)
[ -d "dsu/$tag/zero" ] || { echo "FAIL: latest_universal names $tag, not a folder"; fail=1; }
[ "$(ls -A dsu | tr '\n' ' ')" = "$tag latest_universal " ] || { echo "FAIL: root holds $(ls -A dsu)"; fail=1; }
echo "deepspeed-universal --into-root: $(grep placed: out.txt)"

[ "$fail" = 0 ] && echo "output_folder_cli_test: ok"
exit $fail
