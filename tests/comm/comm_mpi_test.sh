#!/usr/bin/env bash
# offload/comm under mpirun (Debian's OpenMPI 4.1):
#  1. offload_comm_mpi_test at -np 1, 2, 3 and 4: every collective against a serial reference,
#     deterministic sums bitwise, dp x sp splits. Every rank must pass.
#  2. A dead peer: rank 1 of 2, 3 and 4 processes is SIGKILLed while the others are in
#     all-reduces. mpirun must end them and exit non-zero within 30 s of the death, with no
#     process left. (OpenMPI does this itself: "mpirun noticed that process rank 1 ... exited on
#     signal 9", 1.0 s after the death here, so the communicator has no heartbeat of its own.)
#  3. Communicator::Abort(3) on rank 1: the job ends with exit code 3, just as fast.
# usage: comm_mpi_test.sh OFFLOAD_COMM_MPI_TEST OFFLOAD_COMM_KILL_PEER
set -euo pipefail
test_bin=$1
kill_bin=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# The test runs as root in CI, on 2 cores; shared memory only, no network.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none

for n in 1 2 3 4; do
  if ! timeout 120 mpirun -np "$n" "$test_bin" --gtest_brief=1 >np$n.log 2>&1; then
    cat np$n.log
    echo "offload_comm_mpi_test failed at -np $n"
    exit 1
  fi
  echo "$(grep "^np $n: all ranks passed" np$n.log) ($SECONDS s so far)"
done

# dead_peer MODE NP EXPECTED_RC: run the job, check its exit code and how fast it ended.
dead_peer() {
  local mode=$1 n=$2 want=$3 rc end died secs
  set +e
  timeout 60 mpirun -np "$n" "$kill_bin" "$mode" >$mode$n.log 2>&1
  rc=$?
  set -e
  end=$(date +%s.%N)
  if [ "$rc" -eq 124 ] || grep -q survived $mode$n.log; then
    cat $mode$n.log
    echo "$mode at -np $n: the other processes did not end (exit $rc)"
    exit 1
  fi
  if [ "$rc" -ne "$want" ]; then
    cat $mode$n.log
    echo "$mode at -np $n: mpirun exited $rc, expected $want"
    exit 1
  fi
  died=$(sed -n 's/^rank 1 dies at //p' $mode$n.log)
  [ -n "$died" ] || { cat $mode$n.log; echo "no time of death"; exit 1; }
  secs=$(awk -v a="$died" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
  awk -v s="$secs" 'BEGIN { exit !(s < 30) }' || {
    echo "$mode at -np $n: the job took $secs s to end"; exit 1; }
  # The job's processes, not this script (whose arguments name the binary too).
  local left="^$kill_bin (sigkill|abort)"
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pgrep -f "$left" >/dev/null || break
    sleep 0.5
  done
  if pgrep -f "$left" >/dev/null; then
    echo "$mode at -np $n: processes left behind:"; pgrep -af "$left"; exit 1
  fi
  echo "$mode of rank 1 at -np $n: mpirun exited $rc, $secs s after the death, none left"
}
for n in 2 3 4; do dead_peer sigkill "$n" 137; done
grep -q "exited on signal 9" sigkill4.log || { cat sigkill4.log; exit 1; }
dead_peer abort 3 3
