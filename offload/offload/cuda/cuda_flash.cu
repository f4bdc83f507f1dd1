// Causal attention on the tensor cores without the T x T buffers (cuda_ops.h
// AttentionForwardFlash / AttentionBackwardFlash): FlashAttention-2's tiling (Dao, 2023) over
// the fused qkv rows, written with the WMMA API (16 x 16 x 16 bf16 products, fp32 accumulation).
//
// A block owns 64 queries (forward, dq) or 64 keys (dk, dv) of one (sequence, head) or (sequence,
// KV group); each of its 4 warps owns 16 of those rows. Tiles of the other side (64 rows) are
// read from qkv in fp32, rounded to bf16 (nearest even, as the GEMM attention rounds them) into
// shared memory, and multiplied there. The softmax runs on the scores the warp stores to shared
// memory, one lane per half row, in fp32; the probabilities and dS are rounded to bf16 for the
// next product, as in the GEMM attention. WMMA does not say which accumulator element is which
// (row, column); each warp loads a fragment of the numbers r * 16 + c once and reads its
// elements' places from it (the accumulator layout is fixed per fragment type), so the
// rescaling and the read-modify-writes of the outputs run on the fragments in registers.
//
// Determinism: no atomics. Each output element has one writer; every sum runs in a fixed order
// (a query's keys tile by tile, a key's queries tile by tile and its group's heads in order), so
// dq has its own kernel (FlashAttention-2 adds it up in atomics). Each query's D = sum_j p_j dp_j
// is dout . out when the forward's output is given (7 tile products per tile pair), else the dq
// kernel first walks its keys for it (9). The kernels live in cuda_flash_kernels.h, which
// kernels_emulated_test.cc also runs on a CPU.
#include <cuda_runtime.h>

#include <string>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_flash_kernels.h"
#include "offload/cuda/cuda_kernels.cuh"
#include "offload/cuda/cuda_ops.h"
#include "offload/model/gpu_sizes.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

using internal::Launched;
using namespace flash;  // NOLINT: the kernels and their sizes

// Kernels past 48 KiB of dynamic shared memory must say so first (Hopper: up to 227 KiB).
template <typename Kernel>
Status AllowSmem(Kernel kernel, int bytes, const char* what) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) !=
      cudaSuccess) {
    return Launched(what);
  }
  return Status::Ok();
}

Status CheckFlash(const char* what, int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                  int64_t scratch_bytes) {
  for (int64_t s : {B, T, NH, KV, hd}) {
    if (s < 0) return InvalidArgumentError(std::string(what) + ": negative size " + std::to_string(s));
  }
  if (KV < 1 || NH % KV != 0) {
    return InvalidArgumentError(std::string(what) + ": kv_heads must divide heads");
  }
  if (!FlashAttentionSupports(hd)) {
    return InvalidArgumentError(std::string(what) + ": head_dim " + std::to_string(hd) +
                                " (the flash kernels take 64, 80, 96 or 128)");
  }
  if (B * NH > 65535) {
    return InvalidArgumentError(std::string(what) + ": batch x heads " + std::to_string(B * NH) +
                                " > 65535");
  }
  const int64_t need = gpu::FlashAttentionScratchBytes(B, T, NH, KV, hd);
  if (scratch_bytes < need) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(scratch_bytes) +
                                " bytes of scratch, " + std::to_string(need) +
                                " needed (FlashAttentionScratchBytes)");
  }
  return Status::Ok();
}

// The kernels read bf16 tiles (cp.async, 16-byte pieces): qkv, and for the backward dout, are
// rounded into the scratch first (nearest even, as the GEMM attention rounds them).
template <int HD>
Status Forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t NH,
               int64_t KV, char* scratch, cudaStream_t st) {
  constexpr int bytes = Carved<HD, 3, 1>::kBytes;
  UCP_RETURN_IF_ERROR(AllowSmem(FlashForwardKernel<HD>, bytes, "flash attention forward"));
  const gpu::FlashScratch f = gpu::FlashLayout(B, T, NH, KV, HD);
  auto* qkv16 = reinterpret_cast<bf16*>(scratch + f.qkv16);
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(qkv, reinterpret_cast<uint16_t*>(qkv16),
                                     B * T * (NH + 2 * KV) * HD, st));
  const float scale = 1.0f / sqrtf(static_cast<float>(HD));
  FlashForwardKernel<HD><<<dim3(Tiles(T), static_cast<unsigned>(B * NH)), kThreadsPerBlock, bytes,
                           st>>>(out, lse, qkv16, T, NH, KV, scale);
  return Launched("flash attention forward");
}

template <int HD>
Status Backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV, char* scratch,
                cudaStream_t st) {
  constexpr int qbytes = Carved<HD, 4, 1>::kBytes, kbytes = Carved<HD, 4, 2>::kBytes;
  UCP_RETURN_IF_ERROR(
      AllowSmem(FlashBackwardQueryKernel<HD>, qbytes, "flash attention backward (queries)"));
  UCP_RETURN_IF_ERROR(
      AllowSmem(FlashBackwardKeyKernel<HD>, kbytes, "flash attention backward (keys)"));
  const gpu::FlashScratch f = gpu::FlashLayout(B, T, NH, KV, HD);
  auto* qkv16 = reinterpret_cast<bf16*>(scratch + f.qkv16);
  auto* dout16 = reinterpret_cast<bf16*>(scratch + f.dout16);
  auto* dsum = reinterpret_cast<float*>(scratch + f.d);
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(qkv, reinterpret_cast<uint16_t*>(qkv16),
                                     B * T * (NH + 2 * KV) * HD, st));
  UCP_RETURN_IF_ERROR(
      CastFp32ToBf16(dout, reinterpret_cast<uint16_t*>(dout16), B * T * NH * HD, st));
  const float scale = 1.0f / sqrtf(static_cast<float>(HD));
  if (out != nullptr) {
    const int64_t rows = B * NH * T;
    FlashRowDotKernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, st>>>(
        dsum, dout, out, B, T, NH, HD);
    UCP_RETURN_IF_ERROR(Launched("flash attention backward (D)"));
  }
  FlashBackwardQueryKernel<HD><<<dim3(Tiles(T), static_cast<unsigned>(B * NH)), kThreadsPerBlock,
                                 qbytes, st>>>(dqkv, dsum, dout16, qkv16, lse, T, NH, KV, scale,
                                               out != nullptr);
  UCP_RETURN_IF_ERROR(Launched("flash attention backward (queries)"));
  FlashBackwardKeyKernel<HD><<<dim3(Tiles(T), static_cast<unsigned>(B * KV)), kThreadsPerBlock,
                               kbytes, st>>>(dqkv, dsum, dout16, qkv16, lse, T, NH, KV, scale);
  return Launched("flash attention backward (keys)");
}

}  // namespace

bool FlashAttentionSupports(int64_t head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
}

int64_t FlashAttentionScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  return gpu::FlashAttentionScratchBytes(B, T, NH, KV, hd);
}

Status AttentionForwardFlash(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                             int64_t NH, int64_t KV, int64_t hd, void* scratch,
                             int64_t scratch_bytes, void* stream) {
  UCP_RETURN_IF_ERROR(CheckFlash("flash attention forward", B, T, NH, KV, hd, scratch_bytes));
  if (B * T == 0) return Status::Ok();
  auto st = static_cast<cudaStream_t>(stream);
  auto* sc = static_cast<char*>(scratch);
  switch (hd) {
    case 64: return Forward<64>(out, lse, qkv, B, T, NH, KV, sc, st);
    case 80: return Forward<80>(out, lse, qkv, B, T, NH, KV, sc, st);
    case 96: return Forward<96>(out, lse, qkv, B, T, NH, KV, sc, st);
    default: return Forward<128>(out, lse, qkv, B, T, NH, KV, sc, st);
  }
}

Status AttentionBackwardFlash(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                              int64_t hd, void* scratch, int64_t scratch_bytes, void* stream) {
  UCP_RETURN_IF_ERROR(CheckFlash("flash attention backward", B, T, NH, KV, hd, scratch_bytes));
  if (B * T == 0) return Status::Ok();
  auto st = static_cast<cudaStream_t>(stream);
  auto* sc = static_cast<char*>(scratch);
  switch (hd) {
    case 64: return Backward<64>(dqkv, dout, qkv, out, lse, B, T, NH, KV, sc, st);
    case 80: return Backward<80>(dqkv, dout, qkv, out, lse, B, T, NH, KV, sc, st);
    case 96: return Backward<96>(dqkv, dout, qkv, out, lse, B, T, NH, KV, sc, st);
    default: return Backward<128>(dqkv, dout, qkv, out, lse, B, T, NH, KV, sc, st);
  }
}

}  // namespace ucp::offload::cuda
