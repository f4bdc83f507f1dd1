// The offloaded optimizer pipeline's CUDA backend (offload/engine/pipeline.h): gradients leave the
// GPU bucket by bucket on a copy stream (checked finite on the device first; cast to bf16 on the
// device when the link carries bf16), and the updated bf16/fp16 weights come back the same way.
// The pipeline's scheduling, speculation and validation are the CPU twin's, unchanged.
//
// Limits (refused by Pipeline::Create through host_addressable()): no tail buckets (they need a
// GPU Adam) and no fp32 training. The host staging is the pipeline's ordinary memory, so the
// copies are synchronous with respect to the host thread that issues them (the copy-stream
// thread, which is what the pipeline expects); pinning it is the next step for overlap.
#pragma once

#include <memory>

#include "offload/engine/pipeline.h"
#include "ucp/base/result.h"

namespace ucp::offload::cuda {

/// A backend on its own non-blocking copy stream of the current device.
/// Errors: kDeviceError (no device; stream or buffer allocation).
Result<std::unique_ptr<PipelineBackend>> CudaPipelineBackend();

}  // namespace ucp::offload::cuda
