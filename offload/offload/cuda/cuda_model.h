// The model on the GPU (issue 12): the CPU model's graph (offload/model/model_graph.h, the same
// RunGraph) over the CUDA ops (cuda_ops.h), fp32 activations in device memory. Checked
// against the CPU model on the same weights and batch by cuda_model_test (label gpu).
//
// The trainer runs it through cuda_train_device.h (`ucp-train --device cuda`). Not yet: bf16
// GEMMs in the graph (the ops exist: MatmulForwardBf16; the device widens the bf16 weights into
// an fp32 copy this graph reads), sequence parallelism (NCCL all-to-alls), backward hooks are
// passed through (the overlapped pipeline's: cuda_train_device.cc orders each bucket's copy
// after its group's kernels with an event).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "offload/model/model.h"
#include "ucp/base/result.h"

namespace ucp::offload::cuda {

class CudaModel {
 public:
  /// Activations for micro-batches up to max_batch x max_seq_len on the current device.
  /// Errors: kInvalidArgument (config, sizes), kDeviceError (no device, allocation, cuBLAS).
  static Result<CudaModel> Create(const ModelConfig& config, int64_t max_batch,
                                  int64_t max_seq_len);
  CudaModel(CudaModel&&) noexcept;
  CudaModel& operator=(CudaModel&&) noexcept;
  ~CudaModel();

  const ModelConfig& config() const;
  /// The CPU model's parameter table: the same flat layout.
  const std::vector<ParamInfo>& params() const;
  int64_t num_params() const;

  /// `weights` and `grads`: device (or managed) pointers to num_params() floats; the batch's
  /// tokens are host memory (copied in). As Model::Forward / ForwardBackward (backward adds into
  /// grads), synchronised at the end (the loss is returned to the host).
  /// Errors: kInvalidArgument (batch sizes, a token >= vocab), kDeviceError.
  Result<double> Forward(const float* weights, const Batch& batch);
  /// `hook` (optional): RunGraph's, called on this thread as each grad group's backward kernels
  /// are queued on stream(); record an event there to order work after them.
  Result<double> ForwardBackward(const float* weights, float* grads, const Batch& batch,
                                 float grad_scale, const BackwardHook* hook = nullptr);
  /// The stream every kernel of the model runs on (a cudaStream_t).
  void* stream() const;

 private:
  struct Impl;
  explicit CudaModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::offload::cuda
