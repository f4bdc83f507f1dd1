#!/usr/bin/env bash
# --pipeline overlap under mpirun (trainer_overlap_mpi_test.cc): bitwise the sync path at dp=2
# and dp=4 (and dp=2 x sp=2), ZeRO 0-3, GPT and LLaMA, and the dp=2 trace; the trainer's device
# code path (the CPU twin device) bitwise the CPU trainer at dp=2 and 4, with whole and staged
# host buffers (a staged checkpoint resumed on the CPU); --recompute auto agreed over the ranks.
# Every rank must pass.
# usage: trainer_overlap_mpi_test.sh OFFLOAD_TRAIN_OVERLAP_MPI_TEST
set -euo pipefail
test_bin=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export UCP_OVERLAP_WORK=$work
# As tests/engine/elastic_test.sh: root in CI, 2 cores, shared memory only, no core binding.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_hwloc_base_binding_policy=none
# Ranks share the cores with their own backward workers: a rank waiting in a collective (the
# communicator thread) must yield its core rather than spin, or the peer it waits for starves.
export OMPI_MCA_mpi_yield_when_idle=1
for n in 2 4; do
  rm -rf "${work:?}"/*
  if ! timeout 240 mpirun -np "$n" "$test_bin" --gtest_brief=1 >"$work/../overlap_np$n.log" 2>&1; then
    cat "$work/../overlap_np$n.log"
    echo "offload_train_overlap_mpi_test failed at -np $n"
    exit 1
  fi
  grep -h "^trace\|^np $n: " "$work/../overlap_np$n.log"
  echo "($SECONDS s so far)"
done
