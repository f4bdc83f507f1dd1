#!/usr/bin/env bash
# Crash consistency (issue 16's standing campaign), label `slow`. Usage: BIN_DIR [TRIALS].
# SIGKILL at a random moment of `ucp convert`, `extract`, `reshard`, `convert --format deepspeed`
# (and `ucp-train --save-every 1` when built): TRIALS trials in all (default 120). After each,
# the destination is absent or complete and `ucp verify` passes, the source is byte-identical
# (sha256), and no half-written output is visible under the destination's name.
# Then SIGINT and SIGTERM trials (issue 15): ucp stops with exit 130 / 143 (or had finished:
# 0), the destination is again absent or complete, and nothing is left behind: no DST.tmp-*
# folder, no .tmp- file (ucp removes its temporaries on these signals, io/interrupt.h); the same
# for `ucp-train --save-every 1` (no step_N.tmp-* folder) and for `mpirun -np 2 ucp convert`
# signalled through mpirun.
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

# SIGINT / SIGTERM: exit 130 / 143 (or 0: finished first), the destination absent or complete,
# nothing left behind. Job control gives each background job its own process group, so it keeps
# SIGINT (a non-interactive shell starts background jobs with SIGINT ignored, which ucp honours).
set -m
sig_trials=0
wait_code() {  # PID: sets rc to its exit code (not in a subshell: wait needs the job)
  rc=0
  wait "$1" 2>/dev/null || rc=$?
}
leftover_check() {  # DIR PATTERN LABEL
  local left
  # A process signalled before it made DIR left nothing (and find's failure on a missing DIR
  # would end this script under pipefail).
  [ -d "$1" ] || return 0
  left=$(find "$1" -maxdepth 2 -name "$2" 2>/dev/null | wc -l)
  if [ "$left" -gt 0 ]; then
    echo "FAIL: $3 left: $(find "$1" -maxdepth 2 -name "$2" | tr '\n' ' ')"
    leftovers=$((leftovers + left)); fail=1
  fi
}
for sig in INT TERM; do
  want=$([ "$sig" = INT ] && echo 130 || echo 143)
  for ((i = 0; i < 12; i++)); do
    op=${ops[$((i % ${#ops[@]}))]}
    IFS='|' read -r name srcname words <<<"$op"
    dst="$work/sig_${sig}_${name}_$i"
    # shellcheck disable=SC2086
    "$ucp" $words "$dst" >/dev/null 2>&1 &
    pid=$!
    sleep "$(printf '0.%03d' $(( RANDOM % (dur_ms[$name] + 5) )))"
    kill -"$sig" "$pid" 2>/dev/null || true
    wait_code "$pid"
    sig_trials=$((sig_trials + 1))
    # 143 for SIGINT too: a signal that lands before main() blocks it takes the default action.
    case "$rc" in 0 | "$want" | 143) ;; *) echo "FAIL: $name after SIG$sig: exit $rc"; fail=1 ;; esac
    check_dst "$dst" "$name" "$srcname"
    leftover_check "$work" "$(basename "$dst")*.tmp-*" "$name after SIG$sig"
    rm -rf "$dst" "$dst".tmp-*
  done
done
if [ -x "$bin/ucp-train" ] && [[ "$train_help" == *--save-every* ]]; then
  for ((i = 0; i < 6; i++)); do
    out="$work/train_sig_$i"
    sig=$([ $((i % 2)) = 0 ] && echo TERM || echo INT)
    "$bin/ucp-train" --model gpt-tiny --steps 4 --save-every 1 --out "$out" >/dev/null 2>&1 &
    pid=$!
    sleep "0.$(( RANDOM % 9 + 1 ))"
    kill -"$sig" "$pid" 2>/dev/null || true
    wait_code "$pid"
    sig_trials=$((sig_trials + 1))
    case "$rc" in 0 | 130 | 143) ;; *) echo "FAIL: ucp-train after SIG$sig: exit $rc"; fail=1 ;; esac
    leftover_check "$out" "*.tmp-*" "ucp-train after SIG$sig"
    rm -rf "$out"
  done
fi
if command -v mpirun >/dev/null; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader \
    OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_hwloc_base_binding_policy=none
  for ((i = 0; i < 6; i++)); do
    dst="$work/sig_mpi_$i"
    mpirun -np 2 "$ucp" convert "$work/dist" "$dst" --layout tp=1,pp=2,dp=2,zero=2 >/dev/null 2>&1 &
    pid=$!
    sleep "0.$(( RANDOM % 9 + 1 ))"
    kill -TERM "$pid" 2>/dev/null || true
    wait_code "$pid"
    sig_trials=$((sig_trials + 1))
    check_dst "$dst" "mpirun convert" dist
    leftover_check "$work" "sig_mpi_$i.tmp-*" "mpirun convert after SIGTERM"
    rm -rf "$dst" "$dst".tmp-*
  done
fi

echo "crash consistency: $((per_op * ${#ops[@]})) SIGKILL trials ($killed killed mid-run," \
     "$completed finished first), $train_trials ucp-train --save-every 1 trials," \
     "$sig_trials SIGINT/SIGTERM trials (ucp, ucp-train, mpirun) leaving $leftovers temporaries"
exit $fail
