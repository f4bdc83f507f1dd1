# Every third-party dependency is found here, once, from Debian's packages (tools/setup.sh).
include_guard(GLOBAL)
set(UCP_SOURCE_ROOT ${PROJECT_SOURCE_DIR})

find_package(Threads REQUIRED)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(TBB REQUIRED)
find_package(Boost 1.74 REQUIRED COMPONENTS program_options)
find_package(PkgConfig REQUIRED)
pkg_check_modules(ZSTD REQUIRED IMPORTED_TARGET libzstd)

# HDF5's find module gives variables, not a target; wrap them so the rest links one name.
if(NOT TARGET ucp_third_party_hdf5)
  add_library(ucp_third_party_hdf5 INTERFACE)
  target_include_directories(ucp_third_party_hdf5 SYSTEM INTERFACE ${HDF5_INCLUDE_DIRS})
  target_link_libraries(ucp_third_party_hdf5 INTERFACE ${HDF5_C_LIBRARIES})
  target_compile_definitions(ucp_third_party_hdf5 INTERFACE ${HDF5_DEFINITIONS})
endif()

if(UCP_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# CUDA and NCCL are optional: the CUDA targets build wherever nvcc exists, even with no GPU.
set(UCP_HAVE_CUDA OFF)
if(UCP_ENABLE_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # Before enable_language: it caches nvcc's own default (sm_75 with CUDA 13) when unset, and
    # sm_75 PTX would JIT on the H200 without native bf16. H100/H200 (sm_90) is what the device
    # checks run on; one arch keeps CI builds short. -DCMAKE_CUDA_ARCHITECTURES=... overrides it.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND)
      set(UCP_HAVE_CUDA ON)
      find_library(UCP_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
      find_path(UCP_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    endif()
  endif()
endif()
message(STATUS "ucp: CUDA targets ${UCP_HAVE_CUDA}")

# MPI (Debian's OpenMPI) runs distributed conversion and multi-process saves (ucp/mpi).
find_package(MPI REQUIRED COMPONENTS C)
