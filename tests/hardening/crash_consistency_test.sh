#!/usr/bin/env bash
# Crash consistency (issue 16's standing campaign), label `slow`. Usage: BIN_DIR [TRIALS].
# SIGKILL at a random moment of `ucp convert`, `extract`, `reshard`, `convert --format deepspeed`
# (and `ucp-train --save-every 1` when built): TRIALS trials in all (default 120). After each,
# the destination is absent or complete and `ucp verify` passes, the source is byte-identical
# (sha256), and no half-written output is visible under the destination's name.
# Then SIGINT and SIGTERM trials: the destination must again be absent or complete; what is left
# behind (DST.tmp-* folders: ucp has no signal handler yet, issue 15) is counted and reported as
# a known gap, not a failure. Set UCP_CRASH_STRICT_SIGNALS=1 to make leftovers fail (for the
# fix of issue 15).
set -euo pipefail
bin=$1
trials=${2:-120}
ucp=$bin/ucp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
RANDOM=16  # reproducible moments

"$ucp" generate --model llama-tiny --layout tp=2,pp=2,dp=2,zero=1 --seed 1 --out "$work/dist" \
  >/dev/null
"$ucp" extract "$work/dist" "$work/univ" >/dev/null
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
sums "$work/dist" >"$work/dist.sha"
sums "$work/univ" >"$work/univ.sha"

# name | source | command words (DST appended)
ops=("convert|dist|convert $work/dist --layout tp=1,pp=2,dp=2,zero=2"
     "extract|dist|extract $work/dist"
     "reshard|univ|reshard $work/univ --layout tp=4,pp=1,dp=1"
     "to_deepspeed|dist|convert $work/dist --format deepspeed --layout tp=2,pp=1,dp=2,zero=1")

# How long each op takes here, so the kill moments spread over the whole run.
declare -A dur_ms
for op in "${ops[@]}"; do
  IFS='|' read -r name srcname words <<<"$op"
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  "$ucp" $words "$work/time_$name" >/dev/null 2>&1 || { echo "FAIL: $name does not run"; exit 1; }
  dur_ms[$name]=$(( ($(date +%s%N) - t0) / 1000000 + 1 ))
  rm -rf "$work/time_$name"
done

fail=0 killed=0 completed=0 leftovers=0 train_trials=0
check_dst() {  # dst name srcname -> checks destination and source
  local dst=$1 name=$2 srcname=$3
  if [ -e "$dst" ]; then
    if [ "$name" = to_deepspeed ]; then
      "$ucp" inspect "$dst" >/dev/null 2>&1 || { echo "FAIL: $name left an unreadable $dst"; fail=1; }
    elif ! "$ucp" verify "$dst" >/dev/null 2>&1; then
      echo "FAIL: $name left $dst that does not verify"; fail=1
    fi
  fi
  if ! cmp -s <(sums "$work/$srcname") "$work/$srcname.sha"; then
    echo "FAIL: $name changed its source $srcname"; fail=1
  fi
}

per_op=$(( (trials + ${#ops[@]} - 1) / ${#ops[@]} ))
for op in "${ops[@]}"; do
  IFS='|' read -r name srcname words <<<"$op"
  for ((i = 0; i < per_op; i++)); do
    dst="$work/out_${name}_$i"
    delay_ms=$(( RANDOM % (dur_ms[$name] + 5) ))
    # shellcheck disable=SC2086
    "$ucp" $words "$dst" >/dev/null 2>&1 &
    pid=$!
    sleep "$(printf '0.%03d' "$delay_ms")" 2>/dev/null || sleep "$((delay_ms / 1000))"
    if kill -KILL "$pid" 2>/dev/null; then killed=$((killed + 1)); else completed=$((completed + 1)); fi
    wait "$pid" 2>/dev/null || true
    check_dst "$dst" "$name" "$srcname"
    rm -rf "$dst" "$dst".tmp-*
  done
done

train_help=$("$bin/ucp-train" --help 2>&1 || true)
if [ -x "$bin/ucp-train" ] && [[ "$train_help" == *--save-every* ]]; then
  for ((i = 0; i < 10; i++)); do
    out="$work/train_$i"
    train_trials=$((train_trials + 1))
    "$bin/ucp-train" --model gpt-tiny --steps 4 --save-every 1 --out "$out" >/dev/null 2>&1 &
    pid=$!
    sleep "0.$(( RANDOM % 9 + 1 ))"
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    for ck in "$out"/*/; do
      [ -d "$ck" ] || continue
      case "$ck" in *.tmp-*) continue ;; esac
      [ -f "$ck/manifest.json" ] || [ -f "$ck/ucp_layout.json" ] || continue
      "$ucp" verify "$ck" >/dev/null 2>&1 || { echo "FAIL: ucp-train left $ck unverifiable"; fail=1; }
    done
    rm -rf "$out"
  done
fi

# SIGINT / SIGTERM: the destination is absent or complete; leftovers are the known gap (issue 15).
for sig in INT TERM; do
  for ((i = 0; i < 8; i++)); do
    op=${ops[$((i % ${#ops[@]}))]}
    IFS='|' read -r name srcname words <<<"$op"
    dst="$work/sig_${sig}_${name}_$i"
    # shellcheck disable=SC2086
    "$ucp" $words "$dst" >/dev/null 2>&1 &
    pid=$!
    sleep "$(printf '0.%03d' $(( RANDOM % (dur_ms[$name] + 5) )))"
    kill -"$sig" "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    check_dst "$dst" "$name" "$srcname"
    left=$(compgen -G "$dst.tmp-*" | wc -l || true)
    leftovers=$((leftovers + left))
    rm -rf "$dst" "$dst".tmp-*
  done
done

echo "crash consistency: $((per_op * ${#ops[@]})) SIGKILL trials ($killed killed mid-run," \
     "$completed finished first), $train_trials ucp-train --save-every 1 trials," \
     "16 SIGINT/SIGTERM trials leaving $leftovers DST.tmp-* folders"
if [ "$leftovers" -gt 0 ]; then
  echo "known gap (issue 15): SIGINT/SIGTERM leave DST.tmp-* behind; no half output is visible"
  [ "${UCP_CRASH_STRICT_SIGNALS:-0}" = 1 ] && fail=1
fi
exit $fail
