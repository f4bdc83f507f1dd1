// ProcessGroup over MPI (the only folder that includes mpi.h). `ucp` uses it when started by an
// MPI launcher (mpirun, srun), and trainers can hand it to RankSaver so that every process
// saves its own ranks. Without a launcher nothing here initialises MPI.
#pragma once

#include <memory>

#include "ucp/api/process_group.h"
#include "ucp/base/result.h"

namespace ucp::mpi {

/// True when the environment says an MPI launcher started this process (OMPI_COMM_WORLD_SIZE,
/// PMI_SIZE or PMIX_RANK is set).
bool LaunchedByMpi();

/// MPI_COMM_WORLD as a ProcessGroup. The first call initialises MPI (unless the caller did);
/// MPI is finalised when the last group made here is destroyed, if this code initialised it.
/// Errors: kInternal when MPI fails to initialise.
Result<std::unique_ptr<api::ProcessGroup>> WorldGroup();

}  // namespace ucp::mpi
