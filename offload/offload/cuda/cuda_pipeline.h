// The offloaded optimizer pipeline's CUDA backend (offload/engine/pipeline.h): gradients leave the
// GPU bucket by bucket on a copy stream (checked finite on the device first; cast to bf16 on the
// device when the link carries bf16), and the updated bf16/fp16 weights come back the same way.
// The pipeline's scheduling, speculation and validation are the CPU twin's, unchanged.
//
// Limits (refused by Pipeline::Create through host_addressable()): tail buckets only where the
// caller steps them (PipelineOptions::tail_stepped_by_caller: the CUDA device's Adam), and no
// fp32 training. The host staging is pinned when the caller passes its own
// registered buffers (PipelineMemory::h_grad / h_weights: the trainer's, which the CUDA device
// pins); the pipeline's own staging is ordinary memory, so its copies run at pageable speed.
// Each call returns when its copies are done (the copy-stream thread is the one that waits).
#pragma once

#include <functional>
#include <memory>

#include "offload/engine/pipeline.h"
#include "ucp/base/result.h"

namespace ucp::offload::cuda {

/// Called before bucket `index`'s gradient is read, with the backend's copy stream (a
/// cudaStream_t), to order the copy after the kernels that wrote the gradient (the trainer's
/// device waits there on the event it recorded when the bucket's grad group was queued).
using BeforeGradCopy = std::function<Status(int index, void* copy_stream)>;

/// A backend on its own non-blocking copy stream of the current device. Without `before_copy`
/// the caller must have finished the gradient's kernels before handing a bucket over.
/// Errors: kDeviceError (no device; stream or buffer allocation).
Result<std::unique_ptr<PipelineBackend>> CudaPipelineBackend(BeforeGradCopy before_copy = nullptr);

}  // namespace ucp::offload::cuda
