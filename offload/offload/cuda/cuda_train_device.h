// The trainer's CUDA device (offload/train/device.h; `ucp-train --device cuda`): the
// training-dtype weights on the GPU (bf16 there, widened on the device into the fp32 compute
// copy CudaModel's graph reads; fp16 and fp32 runs send the host's fp32 compute copy), forward
// and backward by CudaModel, the gradients to pinned host memory for the CPU Adam on the fp32
// masters, and the tail pieces (--gpu-tail-buckets) stepped by the device Adam (cuda_adam.h)
// on fp32 masters and Adam states held in device memory.
#pragma once

#include <memory>

#include "offload/train/device.h"
#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload::cuda {

/// Makes the device on GPU spec.rank % (device count), registering spec's host buffers as pinned
/// memory (cudaHostRegister) for the lifetime of the device.
/// Errors: kDeviceError (no device, allocation, registration), kResourceExhausted (activations),
/// kInvalidArgument (the spec).
Result<std::unique_ptr<TrainDevice>> MakeCudaTrainDevice(const TrainDeviceSpec& spec);

/// Ok when a CUDA device is visible. The CLIs ask first: the trainer builds its host state (22 B
/// a parameter) before it makes the device, so a machine without a GPU would otherwise spend
/// that time and memory before hearing no. Errors: kDeviceError.
Status CheckCudaDevice();

/// The memory of the GPU a process of rank `rank` uses (rank % device count), bytes: what
/// --weights auto plans for when no --device-memory is given. Errors: kDeviceError.
Result<int64_t> CudaDeviceMemory(int rank);

}  // namespace ucp::offload::cuda
