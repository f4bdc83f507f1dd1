// The pipeline's CUDA backend; see cuda_pipeline.h.
#include "offload/cuda/cuda_pipeline.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_status.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

Status Cuda(cudaError_t err, const char* what) { return CudaStatus(err, what); }

class CudaBackend final : public PipelineBackend {
 public:
  explicit CudaBackend(BeforeGradCopy before_copy) : before_copy_(std::move(before_copy)) {}

  ~CudaBackend() override {
    if (stage16_) cudaFree(stage16_);
    if (d_flag_) cudaFree(d_flag_);
    if (h_flag_) cudaFreeHost(h_flag_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Status Init() {
    UCP_RETURN_IF_ERROR(Cuda(cudaGetDevice(&device_), "current device"));
    UCP_RETURN_IF_ERROR(Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             "copy stream"));
    UCP_RETURN_IF_ERROR(Cuda(cudaMalloc(&d_flag_, sizeof(int)), "finite flag"));
    return Cuda(cudaHostAlloc(&h_flag_, sizeof(int), cudaHostAllocDefault), "finite flag (host)");
  }

  bool host_addressable() const override { return false; }

  Result<bool> GradToHost(const Bucket& bucket, std::span<const float> d_grad,
                          std::span<float> h_grad, std::span<uint16_t> h_grad16,
                          bool fp16_range) override {
    // The pipeline's copy thread: the current device is per thread, and the stream is this one's.
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    if (before_copy_) UCP_RETURN_IF_ERROR(before_copy_(bucket.index, stream_));
    UCP_RETURN_IF_ERROR(Cuda(cudaMemsetAsync(d_flag_, 0, sizeof(int), stream_), "finite flag"));
    const bool narrow = !h_grad16.empty();
    int64_t total = 0;
    for (const BucketPiece& pc : bucket.pieces) total += pc.n;
    if (narrow && total > stage_n_) {
      if (stage16_) cudaFree(stage16_);
      stage16_ = nullptr;
      stage_n_ = 0;
      UCP_RETURN_IF_ERROR(Cuda(cudaMalloc(&stage16_, static_cast<size_t>(total) * 2),
                               "bf16 staging"));
      stage_n_ = total;
    }
    int64_t at = 0;
    for (const BucketPiece& pc : bucket.pieces) {
      const float* src = d_grad.data() + pc.grad_offset;
      UCP_RETURN_IF_ERROR(FlagNonFinite(src, pc.n, fp16_range, d_flag_, stream_));
      if (narrow) {
        // Cast on the device: half the bytes cross the link (SuperOffload's placement-aware cast).
        UCP_RETURN_IF_ERROR(CastFp32ToBf16(src, stage16_ + at, pc.n, stream_));
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(h_grad16.data() + pc.state_offset, stage16_ + at,
                                                 static_cast<size_t>(pc.n) * 2,
                                                 cudaMemcpyDeviceToHost, stream_),
                                 "gradient to host (bf16)"));
        at += pc.n;
      } else {
        UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(h_grad.data() + pc.state_offset, src,
                                                 static_cast<size_t>(pc.n) * 4,
                                                 cudaMemcpyDeviceToHost, stream_),
                                 "gradient to host"));
      }
    }
    UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(h_flag_, d_flag_, sizeof(int),
                                             cudaMemcpyDeviceToHost, stream_),
                             "finite flag to host"));
    UCP_RETURN_IF_ERROR(Cuda(cudaStreamSynchronize(stream_), "gradient transfer"));
    return *h_flag_ == 0;
  }

  Status WeightsToDevice(const Bucket& bucket, std::span<const uint16_t> h_out,
                         std::span<uint16_t> d_weights) override {
    UCP_RETURN_IF_ERROR(Cuda(cudaSetDevice(device_), "selecting the device"));
    for (const BucketPiece& pc : bucket.pieces) {
      UCP_RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(d_weights.data() + pc.grad_offset,
                                               h_out.data() + pc.state_offset,
                                               static_cast<size_t>(pc.n) * 2,
                                               cudaMemcpyHostToDevice, stream_),
                               "weights to device"));
    }
    return Cuda(cudaStreamSynchronize(stream_), "weights transfer");
  }

 private:
  BeforeGradCopy before_copy_;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  uint16_t* stage16_ = nullptr;
  int64_t stage_n_ = 0;
  int* d_flag_ = nullptr;
  int* h_flag_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<PipelineBackend>> CudaPipelineBackend(BeforeGradCopy before_copy) {
  if (DeviceCount() == 0) return DeviceError("CUDA pipeline backend: no CUDA device");
  auto b = std::make_unique<CudaBackend>(std::move(before_copy));
  UCP_RETURN_IF_ERROR(b->Init(), "CUDA pipeline backend");
  return std::unique_ptr<PipelineBackend>(std::move(b));
}

}  // namespace ucp::offload::cuda
