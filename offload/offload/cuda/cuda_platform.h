// What the kernel headers (cuda_flash_kernels.h, cuda_column_kernels.h) compile against: CUDA's
// headers under nvcc, or, for the host tests that run the same kernel source on a CPU
// (UCP_SIMT_EMULATION, kernels_emulated_test.cc), simt_emulation.h's stand-ins.
#pragma once

#ifdef UCP_SIMT_EMULATION
#include "offload/cuda/simt_emulation.h"
// The block's dynamic shared memory (the launch's third argument), 128-byte aligned.
#define UCP_DYNAMIC_SMEM(name) unsigned char* name = ::simt::DynamicSmem()
#else
#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <mma.h>
#define UCP_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif
