// The fused QKV row (Megatron's interleaved query groups): KV group g holds [q of its hpg heads |
// k | v], each hd wide, so a row of (NH + 2 KV) hd values. One definition for the CPU ops, their
// reference twin and the CUDA kernels (nvcc compiles it for both sides).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define UCP_QKV_HOST_DEVICE __host__ __device__
#else
#define UCP_QKV_HOST_DEVICE
#endif

namespace ucp::offload {

struct QkvLayout {
  int64_t hpg, hd, row;  ///< heads per group, head dim, row width
  UCP_QKV_HOST_DEVICE int64_t Q(int64_t h) const {
    return (h / hpg) * (hpg + 2) * hd + (h % hpg) * hd;
  }
  UCP_QKV_HOST_DEVICE int64_t K(int64_t g) const { return g * (hpg + 2) * hd + hpg * hd; }
  UCP_QKV_HOST_DEVICE int64_t V(int64_t g) const { return K(g) + hd; }
};

}  // namespace ucp::offload
