#!/usr/bin/env bash
# A restart loop for ucp-train under mpirun: runs the job at NP processes (data parallel,
# layout dp=NP); when the job fails (a process died: mpirun ends the others within ~1 s), it
# relaunches at the number of processes left — one fewer, lowered to a count the global batch
# divides by — resuming from the newest complete checkpoint, until the run finishes or no process
# is left. A failure that ucp-train reports itself (exit < 128) stops the loop. The global batch, the sample order and the schedule do not change (docs/train.md).
#
#   tools/elastic_run.sh [--np N] [--zero Z] [--max-restarts R] -- UCP_TRAIN_ARGS... --out RUN
#
# UCP_TRAIN_ARGS are given to the first launch; relaunches resume RUN with its recorded config
# (and the same --steps). Env: UCP_TRAIN (the binary; default build/bin/ucp-train), MPIRUN
# (default mpirun). Exit: 0 when the run finished, else the last launch's code.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
train=${UCP_TRAIN:-$here/build/bin/ucp-train}
mpirun=${MPIRUN:-mpirun}
np=4 zero=1 max_restarts=8
while [ $# -gt 0 ]; do
  case "$1" in
    --np) np=$2; shift 2 ;;
    --zero) zero=$2; shift 2 ;;
    --max-restarts) max_restarts=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "elastic_run: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
args=("$@")
run="" steps="" gb=16
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --out) run=${args[i + 1]} ;;
    --steps) steps=${args[i + 1]} ;;
    --global-batch) gb=${args[i + 1]} ;;
  esac
done
[ -n "$run" ] || { echo "elastic_run: --out RUN is required" >&2; exit 2; }

has_checkpoint() { ls -d "$run"/step_*/ucp_layout.json >/dev/null 2>&1; }
# The largest process count <= $1 that divides the global batch.
fit() { local n=$1; while [ "$n" -gt 1 ] && [ $((gb % n)) -ne 0 ]; do n=$((n - 1)); done; echo "$n"; }

np=$(fit "$np")
restarts=0
while :; do
  layout="tp=1,pp=1,dp=$np,zero=$zero"
  if has_checkpoint; then
    echo "elastic_run: resuming $run at $layout ($np processes)"
    cmd=("$train" --resume "$run" --layout "$layout")
    [ -n "$steps" ] && cmd+=(--steps "$steps")
  else
    echo "elastic_run: starting $run at $layout ($np processes)"
    cmd=("$train" "${args[@]}" --layout "$layout")
  fi
  "$mpirun" -np "$np" "${cmd[@]}"
  code=$?
  [ "$code" -eq 0 ] && { echo "elastic_run: $run finished after $restarts restart(s)"; exit 0; }
  restarts=$((restarts + 1))
  # Only a process that died (mpirun reports a signal: exit >= 128) costs a process; an error
  # that ucp-train reported (usage 2, bad input 3-7, ...) would fail again at any count.
  if [ "$code" -lt 128 ]; then
    echo "elastic_run: ucp-train failed with exit $code (not a lost process): stopping" >&2
    exit "$code"
  fi
  if [ "$np" -le 1 ] || [ "$restarts" -gt "$max_restarts" ]; then
    echo "elastic_run: giving up after $restarts failure(s) (exit $code)" >&2
    exit "$code"
  fi
  np=$(fit $((np - 1)))
  echo "elastic_run: the job failed (exit $code); $np process(es) left"
done
