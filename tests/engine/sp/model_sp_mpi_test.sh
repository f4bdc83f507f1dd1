#!/usr/bin/env bash
# Ulysses sequence parallelism of the engine's models under mpirun (Debian's OpenMPI 4.1):
# offload_model_sp_mpi_test at -np 2 and 4 (sp = 2 and 4, and two dp groups of sp = 2 at -np 4).
# Every rank must pass; rank 0 prints the largest difference between the sharded and the
# whole-sequence loss and gradients.
# usage: model_sp_mpi_test.sh OFFLOAD_MODEL_SP_MPI_TEST
set -euo pipefail
test_bin=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
# The test runs as root in CI, on 2 cores; shared memory only, no network; no core binding (4
# processes share 2 cores).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_hwloc_base_binding_policy=none

for n in 2 4; do
  if ! timeout 120 mpirun -np "$n" "$test_bin" --gtest_brief=1 >np$n.log 2>&1; then
    cat np$n.log
    echo "offload_model_sp_mpi_test failed at -np $n"
    exit 1
  fi
  grep "^np $n: largest" np$n.log
  echo "$(grep "^np $n: all ranks passed" np$n.log) ($SECONDS s so far)"
done
