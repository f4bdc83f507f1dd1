// The model's ops on the GPU; see cuda_ops.h for the contracts. Written llm.c style: one kernel
// (or cuBLAS call) per op, the indexing of ops_ref.cc, comments only where the GPU differs.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/cuda_column_kernels.h"
#include "offload/cuda/cuda_kernels.cuh"
#include "offload/cuda/cuda_ops.h"
#include "offload/model/gpu_sizes.h"
#include "offload/model/qkv_layout.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

// The kernels launched with Grid() loop over their range with the grid's stride, so a grid of
// at most this many blocks covers any size (SetMaxGridBlocksForTest lowers it).
constexpr int kMaxGridBlocks = 65535 * 16;
int max_grid_blocks = kMaxGridBlocks;

int Grid(int64_t n, int per_block = kThreads) {
  const int64_t g = (n + per_block - 1) / per_block;
  return static_cast<int>(std::clamp<int64_t>(g, 1, max_grid_blocks));
}

using internal::Launched;

Status Blased(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    return DeviceError(std::string(what) + ": cuBLAS status " + std::to_string(static_cast<int>(st)));
  }
  return Launched(what);
}

Status Positive(const char* what, std::initializer_list<int64_t> sizes) {
  for (int64_t s : sizes) {
    if (s < 0) return InvalidArgumentError(std::string(what) + ": negative size " + std::to_string(s));
  }
  return Status::Ok();
}

__device__ inline float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ inline float BlockSum(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = WarpSum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / kWarp;
  float s = lane < warps ? partial[lane] : 0.0f;
  return WarpSum(s);
}

// Max over the block, as BlockSum.
__device__ inline float BlockMax(float v) {
  __shared__ float partial[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / kWarp;
  float m = lane < warps ? partial[lane] : -INFINITY;
  for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The parameter gradients' column sums (cuda_column_kernels.h): norms' dweight / dbias and the
// matrix products' dbias.
void ColumnGrad(float* dweight, float* dbias, const float* dout, const float* inp,
                const float* mean, const float* rstd, int64_t N, int64_t C, cudaStream_t st) {
  kernels::ColumnGradKernel<<<kernels::ColumnBlocks(C), kernels::kColumnThreads,
                              kernels::kColumnSmemBytes, st>>>(dweight, dbias, dout, inp, mean,
                                                               rstd, N, C);
}

// ---- encoder

__global__ void EncoderForwardKernel(float* out, const int32_t* tokens, const float* wte,
                                     const float* wpe, int64_t B, int64_t T, int64_t C) {
  const int64_t n = B * T * C;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t bt = i / C, c = i % C, t = bt % T;
    out[i] = wte[int64_t{tokens[bt]} * C + c] + (wpe ? wpe[t * C + c] : 0.0f);
  }
}

// ---- norms: a block per row (the weight / bias gradients: ColumnGrad)

__global__ void LayerNormForwardKernel(float* out, float* mean, float* rstd, const float* inp,
                                       const float* w, const float* b, int64_t C, float eps) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += x[c];
  const float m = BlockSum(s) / static_cast<float>(C);
  float v = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) v += (x[c] - m) * (x[c] - m);
  const float r = 1.0f / sqrtf(BlockSum(v) / static_cast<float>(C) + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[n * C + c] = (x[c] - m) * r * w[c] + b[c];
  if (threadIdx.x == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

__global__ void LayerNormBackwardRowKernel(float* dinp, const float* dout, const float* inp,
                                           const float* w, const float* mean, const float* rstd,
                                           int64_t C) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const float* d = dout + n * C;
  const float m = mean[n], r = rstd[n];
  float a = 0.0f, bsum = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (x[c] - m) * r, dnorm = w[c] * d[c];
    a += dnorm;
    bsum += dnorm * norm;
  }
  const float dnorm_mean = BlockSum(a) / static_cast<float>(C);
  const float dnorm_norm_mean = BlockSum(bsum) / static_cast<float>(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float norm = (x[c] - m) * r, dnorm = w[c] * d[c];
    dinp[n * C + c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * r;
  }
}

__global__ void RmsNormForwardKernel(float* out, float* rstd, const float* inp, const float* w,
                                     int64_t C, float eps) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += x[c] * x[c];
  const float r = 1.0f / sqrtf(BlockSum(s) / static_cast<float>(C) + eps);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[n * C + c] = x[c] * r * w[c];
  if (threadIdx.x == 0) rstd[n] = r;
}

__global__ void RmsNormBackwardRowKernel(float* dinp, const float* dout, const float* inp,
                                         const float* w, const float* rstd, int64_t C) {
  const int64_t n = blockIdx.x;
  const float* x = inp + n * C;
  const float* d = dout + n * C;
  const float r = rstd[n];
  float s = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) s += w[c] * d[c] * (x[c] * r);
  const float mean = BlockSum(s) / static_cast<float>(C);
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    dinp[n * C + c] += (w[c] * d[c] - x[c] * r * mean) * r;
  }
}

// ---- matmul helpers

__global__ void BroadcastRowsKernel(float* out, const float* bias, int64_t N, int64_t OC) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * OC;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = bias[i % OC];
  }
}

// ---- attention: a warp per (b, h, t) query; lanes split the head dimension

constexpr int kMaxHdPerLane = 8;  // hd <= 256

// A warp's queries (or keys, below): from its index in the grid, with the grid's warps as the
// stride (Grid() caps the blocks). Every lane of a warp walks the same ones, so the shuffles of
// WarpSum always see the whole warp.
__device__ int64_t FirstWarpItem() {
  return (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) / kWarp;
}
__device__ int64_t WarpStride() { return int64_t{gridDim.x} * blockDim.x / kWarp; }

// One (query, key) pair's q . k and dout . v, the lanes over the head dimension, summed over
// the warp (the backward kernels' shared inner step).
__device__ void WarpDots(const float* q, const float* k, const float* d, const float* v,
                         int64_t hd, int lane, float& s, float& dp) {
  s = 0.0f;
  dp = 0.0f;
  for (int64_t i = lane; i < hd; i += kWarp) {
    s += q[i] * k[i];
    dp += d[i] * v[i];
  }
  s = WarpSum(s);
  dp = WarpSum(dp);
}

__global__ void AttentionForwardKernel(float* out, float* lse, const float* qkv, int64_t B,
                                       int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t query = FirstWarpItem(); query < B * NH * T; query += WarpStride()) {
    const int64_t t = query % T, h = (query / T) % NH, b = query / (T * NH);
    const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
    const int64_t g = h / L.hpg;
    const float scale = 1.0f / sqrtf(static_cast<float>(hd));
    const float* q = qkv + (b * T + t) * L.row + L.Q(h);
    float acc[kMaxHdPerLane] = {0};
    float m = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j <= t; ++j) {
      const float* k = qkv + (b * T + j) * L.row + L.K(g);
      float s = 0.0f;
      for (int64_t i = lane; i < hd; i += kWarp) s += q[i] * k[i];
      s = WarpSum(s) * scale;
      const float m_new = fmaxf(m, s);
      const float corr = expf(m - m_new), p = expf(s - m_new);
      sum = sum * corr + p;
      const float* v = qkv + (b * T + j) * L.row + L.V(g);
      for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) acc[r] = acc[r] * corr + p * v[i];
      m = m_new;
    }
    float* o = out + (b * T + t) * NH * hd + h * hd;
    for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) o[i] = acc[r] / sum;
    if (lane == 0) lse[(b * NH + h) * T + t] = m + logf(sum);
  }
}

// Per query: D = sum_j p_j dp_j (into scratch) and dq += scale sum_j ds_j k_j.
__global__ void AttentionBackwardQueryKernel(float* dqkv, float* dsum_out, const float* dout,
                                             const float* qkv, const float* lse, int64_t B,
                                             int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t query = FirstWarpItem(); query < B * NH * T; query += WarpStride()) {
    const int64_t t = query % T, h = (query / T) % NH, b = query / (T * NH);
    const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
    const int64_t g = h / L.hpg;
    const float scale = 1.0f / sqrtf(static_cast<float>(hd));
    const float* q = qkv + (b * T + t) * L.row + L.Q(h);
    const float* d = dout + (b * T + t) * NH * hd + h * hd;
    const float l = lse[(b * NH + h) * T + t];
    float dsum = 0.0f;
    for (int64_t j = 0; j <= t; ++j) {
      const float* k = qkv + (b * T + j) * L.row + L.K(g);
      const float* v = qkv + (b * T + j) * L.row + L.V(g);
      float s, dp;
      WarpDots(q, k, d, v, hd, lane, s, dp);
      dsum += expf(s * scale - l) * dp;
    }
    float dq[kMaxHdPerLane] = {0};
    for (int64_t j = 0; j <= t; ++j) {
      const float* k = qkv + (b * T + j) * L.row + L.K(g);
      const float* v = qkv + (b * T + j) * L.row + L.V(g);
      float s, dp;
      WarpDots(q, k, d, v, hd, lane, s, dp);
      const float ds = expf(s * scale - l) * (dp - dsum) * scale;
      for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) dq[r] += ds * k[i];
    }
    float* dqp = dqkv + (b * T + t) * L.row + L.Q(h);
    for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) dqp[i] += dq[r];
    if (lane == 0) dsum_out[(b * NH + h) * T + t] = dsum;
  }
}

// Per key (b, g, j): dk_j += sum over the group's heads and queries t >= j of ds q_t, dv_j +=
// sum p dout_t, in a fixed order (no atomics).
__global__ void AttentionBackwardKeyKernel(float* dqkv, const float* dsum_in, const float* dout,
                                           const float* qkv, const float* lse, int64_t B, int64_t T,
                                           int64_t NH, int64_t KV, int64_t hd) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t key = FirstWarpItem(); key < B * KV * T; key += WarpStride()) {
    const int64_t j = key % T, g = (key / T) % KV, b = key / (T * KV);
    const QkvLayout L{NH / KV, hd, (NH + 2 * KV) * hd};
    const float scale = 1.0f / sqrtf(static_cast<float>(hd));
    const float* k = qkv + (b * T + j) * L.row + L.K(g);
    const float* v = qkv + (b * T + j) * L.row + L.V(g);
    float dk[kMaxHdPerLane] = {0}, dv[kMaxHdPerLane] = {0};
    for (int64_t h = g * L.hpg; h < (g + 1) * L.hpg; ++h) {
      for (int64_t t = j; t < T; ++t) {
        const float* q = qkv + (b * T + t) * L.row + L.Q(h);
        const float* d = dout + (b * T + t) * NH * hd + h * hd;
        float s, dp;
        WarpDots(q, k, d, v, hd, lane, s, dp);
        const int64_t row = (b * NH + h) * T + t;
        const float p = expf(s * scale - lse[row]);
        const float ds = p * (dp - dsum_in[row]) * scale;
        for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) {
          dk[r] += ds * q[i];
          dv[r] += p * d[i];
        }
      }
    }
    float* dkp = dqkv + (b * T + j) * L.row + L.K(g);
    float* dvp = dqkv + (b * T + j) * L.row + L.V(g);
    for (int64_t i = lane, r = 0; i < hd; i += kWarp, ++r) {
      dkp[i] += dk[r];
      dvp[i] += dv[r];
    }
  }
}

// ---- rotary: a thread per (b, t, group, head of the group's first hpg + 1, i < hd / 2)

__global__ void RopeKernel(float* qkv, const float* cos_t, const float* sin_t, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd, float sign) {
  const int64_t hpg = NH / KV, half = hd / 2, row = (NH + 2 * KV) * hd;
  const int64_t n = B * T * KV * (hpg + 1) * half;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx % half;
    int64_t rest = idx / half;
    const int64_t h = rest % (hpg + 1);
    rest /= hpg + 1;
    const int64_t g = rest % KV;
    const int64_t bt = rest / KV, t = bt % T;
    float* x = qkv + bt * row + g * (hpg + 2) * hd + h * hd;
    const float c = cos_t[t * half + i], s = sign * sin_t[t * half + i];
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * s;
    x[i + half] = x2 * c + x1 * s;
  }
}

// ---- element-wise

__global__ void GeluForwardKernel(float* out, const float* inp, int64_t n) {
  const float k = sqrtf(2.0f / static_cast<float>(M_PI));
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
  }
}

__global__ void GeluBackwardKernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const float k = sqrtf(2.0f / static_cast<float>(M_PI));
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float x = inp[i];
    const float th = tanhf(k * (x + 0.044715f * x * x * x));
    const float grad = 0.5f * (1.0f + th) +
                       0.5f * x * (1.0f - th * th) * k * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += grad * dout[i];
  }
}

__global__ void SwigluForwardKernel(float* out, const float* inp, int64_t N, int64_t F) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * F;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / F, f = i % F;
    const float g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
    out[i] = g / (1.0f + expf(-g)) * u;
  }
}

__global__ void SwigluBackwardKernel(float* dinp, const float* inp, const float* dout, int64_t N,
                                     int64_t F) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < N * F;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t n = i / F, f = i % F;
    const float g = inp[n * 2 * F + f], u = inp[n * 2 * F + F + f];
    const float sig = 1.0f / (1.0f + expf(-g)), d = dout[i];
    dinp[n * 2 * F + f] += d * u * sig * (1.0f + g * (1.0f - sig));
    dinp[n * 2 * F + F + f] += d * g * sig;
  }
}

__global__ void ResidualForwardKernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    out[i] = a[i] + b[i];
  }
}

__global__ void ResidualBackwardKernel(float* da, float* db, const float* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    da[i] += dout[i];
    db[i] += dout[i];
  }
}

// ---- the gradient norm's chunk sums (offload/train/grad_norm.h SumSquaresAndMax, the same
// operations in the same order): thread (c, j) sums lane j of chunk c, the elements
// c chunk + j + 8k in k order, each square rounded before its add (__dmul_rn and __dadd_rn: nvcc
// would fuse them), and their largest |x| (fmaxf skips a NaN, as the host's std::max does);
// then lane 0 of each chunk adds the 8 lanes in the host's fixed tree. kThreads is a multiple
// of 8, so a chunk's lanes share a block.

__global__ void GradNormChunksKernel(const float* __restrict__ x, int64_t n, int64_t chunk,
                                     int64_t chunks, double* __restrict__ partial,
                                     float* __restrict__ maxabs) {
  __shared__ double acc[kThreads];
  __shared__ float mx[kThreads];
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t c = t / 8;
  const int j = static_cast<int>(t % 8);
  double a = 0.0;
  float m = 0.0f;
  if (c < chunks) {
    const int64_t e = min(n, (c + 1) * chunk);
    for (int64_t i = c * chunk + j; i < e; i += 8) {
      const float v = x[i];
      const double d = static_cast<double>(v);
      a = __dadd_rn(a, __dmul_rn(d, d));
      m = fmaxf(m, fabsf(v));
    }
  }
  acc[threadIdx.x] = a;
  mx[threadIdx.x] = m;
  __syncthreads();
  if (j == 0 && c < chunks) {
    const double* l = acc + threadIdx.x;
    partial[c] = __dadd_rn(__dadd_rn(__dadd_rn(l[0], l[1]), __dadd_rn(l[2], l[3])),
                           __dadd_rn(__dadd_rn(l[4], l[5]), __dadd_rn(l[6], l[7])));
    const float* q = mx + threadIdx.x;
    maxabs[c] = fmaxf(fmaxf(fmaxf(q[0], q[1]), fmaxf(q[2], q[3])),
                      fmaxf(fmaxf(q[4], q[5]), fmaxf(q[6], q[7])));
  }
}

// ---- classifier: a block per row; softmax sums in double as the reference does

// Flags a target past the vocabulary (negative targets are rows left out of the loss).
__global__ void CheckTargetsKernel(const int32_t* targets, int64_t n, int64_t V, int* bad) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (targets[i] >= V) *bad = 1;
  }
}

__global__ void CrossEntropyKernel(float* logits, double* row_loss, int* bad_target,
                                   const int32_t* targets, int64_t V, float grad_scale,
                                   bool backward) {
  const int64_t n = blockIdx.x;
  float* l = logits + n * V;
  const int32_t target = targets[n];
  if (target < 0 || target >= V) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) l[v] = 0.0f;
    if (threadIdx.x == 0) {
      row_loss[n] = 0.0;
      if (target >= V) atomicExch(bad_target, 1);  // a flag, not a sum: order does not matter
    }
    return;
  }
  __shared__ float smax[32];
  __shared__ double ssum[32];
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, l[v]);
  for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  if (lane == 0) smax[warp] = m;
  __syncthreads();
  m = lane < warps ? smax[lane] : -INFINITY;
  for (int o = kWarp / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  double s = 0.0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) s += static_cast<double>(expf(l[v] - m));
  for (int o = kWarp / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) ssum[warp] = s;
  __syncthreads();
  s = lane < warps ? ssum[lane] : 0.0;
  for (int o = kWarp / 2; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) {
    row_loss[n] = log(s) + static_cast<double>(m) - static_cast<double>(l[target]);
  }
  __syncthreads();  // l[target] is read above before any thread overwrites it
  if (!backward) return;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float prob = static_cast<float>(static_cast<double>(expf(l[v] - m)) / s);
    l[v] = grad_scale * (prob - (v == target ? 1.0f : 0.0f));
  }
}

// ---- attention through GEMMs (bf16 training): the kernels between the batched GEMMs. Pair i
// of a pass is (sequence, head) bh = p0 + i; its scores S_i are a row-major T x T fp32 block.

// Row t of pair i: the causal softmax of scale * S_i[t, :t]. Forward (lse_in null): computes
// the row's log-sum-exp into lse; backward: the probabilities from the saved one. Writes the
// probabilities as fp32 over S_i (backward's dS needs them) and as bf16 into P16 (the GEMMs'),
// zero above the diagonal.
__global__ void CausalSoftmaxKernel(float* S, __nv_bfloat16* P16, float* lse_out,
                                    const float* lse_in, int64_t T, int64_t p0, float scale) {
  const int64_t i = blockIdx.x / T, t = blockIdx.x % T;
  float* s = S + (i * T + t) * T;
  __nv_bfloat16* p16 = P16 + (i * T + t) * T;
  const int64_t row = (p0 + i) * T + t;  // lse[(b NH + h) T + t]
  float l;
  if (lse_in == nullptr) {
    float m = -INFINITY;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) m = fmaxf(m, s[j] * scale);
    m = BlockMax(m);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) sum += expf(s[j] * scale - m);
    sum = BlockSum(sum);
    l = m + logf(sum);
    if (threadIdx.x == 0) lse_out[row] = l;
  } else {
    l = lse_in[row];
  }
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
    const float p = j <= t ? expf(s[j] * scale - l) : 0.0f;
    s[j] = p;
    p16[j] = __float2bfloat16_rn(p);
  }
}

// Row t of pair i: dS = P (dP - sum_j P dP) scale, as bf16 over P16 (the probabilities' bf16
// copy is spent by then: dV has read it).
__global__ void SoftmaxBackwardKernel(__nv_bfloat16* dS16, const float* P, const float* dP,
                                      int64_t T, float scale) {
  const int64_t i = blockIdx.x / T, t = blockIdx.x % T;
  const float* p = P + (i * T + t) * T;
  const float* dp = dP + (i * T + t) * T;
  float d = 0.0f;
  for (int64_t j = threadIdx.x; j <= t; j += blockDim.x) d += p[j] * dp[j];
  d = BlockSum(d);
  __nv_bfloat16* ds = dS16 + (i * T + t) * T;
  for (int64_t j = threadIdx.x; j < T; j += blockDim.x) {
    ds[j] = __float2bfloat16_rn(j <= t ? p[j] * (dp[j] - d) * scale : 0.0f);
  }
}

// dk and dv of each (sequence, kv group) of a pass: the sum over the group's hpg heads of the
// per-head products (in head order: deterministic), added into dqkv.
__global__ void GroupKvGradKernel(float* dqkv, const float* dK, const float* dV, int64_t pairs,
                                  int64_t T, int64_t NH, QkvLayout L, int64_t p0) {
  const int64_t groups = pairs / L.hpg, n = groups * T * L.hd;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = e % L.hd, j = (e / L.hd) % T, q = e / (L.hd * T);
    const int64_t bh = p0 + q * L.hpg, b = bh / NH, g = (bh % NH) / L.hpg;
    float sk = 0.0f, sv = 0.0f;
    for (int64_t r = 0; r < L.hpg; ++r) {
      const int64_t at = ((q * L.hpg + r) * T + j) * L.hd + d;
      sk += dK[at];
      sv += dV[at];
    }
    float* base = dqkv + (b * T + j) * L.row;
    base[L.K(g) + d] += sk;
    base[L.V(g) + d] += sv;
  }
}

}  // namespace

// ---- Blas

struct Blas::Impl {
  cublasHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  ~Impl() {
    if (handle) cublasDestroy(handle);
    cudaFree(workspace);
  }
};

Result<Blas> Blas::Create(void* stream) {
  auto impl = std::make_unique<Impl>();
  const cublasStatus_t st = cublasCreate(&impl->handle);
  if (st != CUBLAS_STATUS_SUCCESS) {
    impl->handle = nullptr;
    return DeviceError("cublasCreate: status " + std::to_string(static_cast<int>(st)));
  }
  impl->stream = S(stream);
  if (cublasSetStream(impl->handle, impl->stream) != CUBLAS_STATUS_SUCCESS) {
    return DeviceError("cublasSetStream failed");
  }
  // Tensor-core fp32 emulation (TF32) would change results beyond the stated tolerances.
  cublasSetMathMode(impl->handle, CUBLAS_PEDANTIC_MATH);
  // The workspace cuBLAS's documentation recommends (cublasSetWorkspace): 32 MiB on Hopper and
  // later, whose GEMM kernels can need it, 4 MiB before. The handle's own: one stream uses it,
  // so the GEMMs stay deterministic. (After cublasSetStream, which resets it.)
  int device = 0, major = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  const size_t bytes = size_t{major >= 9 ? 32u : 4u} << 20;
  if (err == cudaSuccess) err = cudaMalloc(&impl->workspace, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    impl->workspace = nullptr;
    return DeviceError(std::string("cuBLAS workspace: ") + cudaGetErrorName(err));
  }
  if (cublasSetWorkspace(impl->handle, impl->workspace, bytes) != CUBLAS_STATUS_SUCCESS) {
    return DeviceError("cublasSetWorkspace failed");
  }
  return Blas(std::move(impl));
}

Blas::Blas(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Blas::Blas(Blas&&) noexcept = default;
Blas& Blas::operator=(Blas&&) noexcept = default;
Blas::~Blas() = default;
void* Blas::stream() const { return impl_->stream; }
void* Blas::handle() const { return impl_->handle; }

// ---- launchers

Status EncoderForward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                      int64_t B, int64_t T, int64_t C, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("encoder forward", {B, T, C}));
  EncoderForwardKernel<<<Grid(B * T * C), kThreads, 0, S(stream)>>>(out, tokens, wte, wpe, B, T, C);
  return Launched("encoder forward");
}

void GroupTokens(const int32_t* tokens, int64_t count, TokenRuns& out) {
  kernels::GroupTokenRuns(tokens, count, out.order, out.starts);
}

Status EncoderBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                       const int32_t* order, const int32_t* starts, int64_t runs, int64_t B,
                       int64_t T, int64_t C, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("encoder backward", {B, T, C, runs}));
  if (B * T * C == 0) return Status::Ok();
  if (runs < 1 || runs > B * T) {
    return InvalidArgumentError("encoder backward: " + std::to_string(runs) + " token runs for " +
                                std::to_string(B * T) + " tokens (GroupTokens)");
  }
  const auto chunks = static_cast<unsigned>((C + kThreads - 1) / kThreads);
  if (chunks > 65535) return InvalidArgumentError("encoder backward: hidden size too large");
  kernels::TokenRunGradKernel<<<dim3(static_cast<unsigned>(runs), chunks), kThreads, 0,
                                 S(stream)>>>(dwte, dout, tokens, order, starts, C);
  UCP_RETURN_IF_ERROR(Launched("encoder backward (tokens)"));
  if (dwpe) {
    kernels::PositionGradKernel<<<Grid(T * C), kThreads, 0, S(stream)>>>(dwpe, dout, B, T, C);
    return Launched("encoder backward (positions)");
  }
  return Status::Ok();
}

Status LayerNormForward(float* out, float* mean, float* rstd, const float* inp,
                        const float* weight, const float* bias, int64_t N, int64_t C, float eps,
                        void* stream) {
  UCP_RETURN_IF_ERROR(Positive("layernorm forward", {N, C}));
  if (N == 0) return Status::Ok();
  LayerNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, S(stream)>>>(
      out, mean, rstd, inp, weight, bias, C, eps);
  return Launched("layernorm forward");
}

Status LayerNormBackward(float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, const float* mean,
                         const float* rstd, int64_t N, int64_t C, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("layernorm backward", {N, C}));
  if (N == 0) return Status::Ok();
  LayerNormBackwardRowKernel<<<static_cast<unsigned>(N), kThreads, 0, S(stream)>>>(
      dinp, dout, inp, weight, mean, rstd, C);
  ColumnGrad(dweight, dbias, dout, inp, mean, rstd, N, C, S(stream));
  return Launched("layernorm backward");
}

Status RmsNormForward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                      int64_t C, float eps, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("rmsnorm forward", {N, C}));
  if (N == 0) return Status::Ok();
  RmsNormForwardKernel<<<static_cast<unsigned>(N), kThreads, 0, S(stream)>>>(out, rstd, inp,
                                                                             weight, C, eps);
  return Launched("rmsnorm forward");
}

Status RmsNormBackward(float* dinp, float* dweight, const float* dout, const float* inp,
                       const float* weight, const float* rstd, int64_t N, int64_t C,
                       void* stream) {
  UCP_RETURN_IF_ERROR(Positive("rmsnorm backward", {N, C}));
  if (N == 0) return Status::Ok();
  RmsNormBackwardRowKernel<<<static_cast<unsigned>(N), kThreads, 0, S(stream)>>>(
      dinp, dout, inp, weight, rstd, C);
  ColumnGrad(dweight, nullptr, dout, inp, nullptr, rstd, N, C, S(stream));
  return Launched("rmsnorm backward");
}

Status MatmulForward(const Blas& blas, float* out, const float* inp, const float* weight,
                     const float* bias, int64_t N, int64_t C, int64_t OC) {
  UCP_RETURN_IF_ERROR(Positive("matmul forward", {N, C, OC}));
  float beta = 0.0f;
  if (bias) {
    BroadcastRowsKernel<<<Grid(N * OC), kThreads, 0, S(blas.stream())>>>(out, bias, N, OC);
    UCP_RETURN_IF_ERROR(Launched("matmul forward bias"));
    beta = 1.0f;
  }
  const float alpha = 1.0f;
  // Row-major out[N, OC] is column-major out^T[OC, N] = W (row-major [OC, C] read transposed)
  // times inp^T (column-major [C, N]).
  return Blased(cublasSgemm(static_cast<cublasHandle_t>(blas.handle()), CUBLAS_OP_T, CUBLAS_OP_N,
                            static_cast<int>(OC), static_cast<int>(N), static_cast<int>(C), &alpha,
                            weight, static_cast<int>(C), inp, static_cast<int>(C), &beta, out,
                            static_cast<int>(OC)),
                "matmul forward");
}

Status MatmulBackward(const Blas& blas, float* dinp, float* dweight, float* dbias,
                      const float* dout, const float* inp, const float* weight, int64_t N,
                      int64_t C, int64_t OC) {
  UCP_RETURN_IF_ERROR(Positive("matmul backward", {N, C, OC}));
  auto h = static_cast<cublasHandle_t>(blas.handle());
  const float one = 1.0f;
  if (dinp) {
    // dinp^T[C, N] += W^T[C, OC] dout^T[OC, N]
    UCP_RETURN_IF_ERROR(Blased(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(C),
                                           static_cast<int>(N), static_cast<int>(OC), &one, weight,
                                           static_cast<int>(C), dout, static_cast<int>(OC), &one,
                                           dinp, static_cast<int>(C)),
                               "matmul backward (input)"));
  }
  // dweight^T[C, OC] += inp^T[C, N] dout[N, OC]
  UCP_RETURN_IF_ERROR(Blased(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(C),
                                         static_cast<int>(OC), static_cast<int>(N), &one, inp,
                                         static_cast<int>(C), dout, static_cast<int>(OC), &one,
                                         dweight, static_cast<int>(C)),
                             "matmul backward (weight)"));
  if (dbias) {
    ColumnGrad(nullptr, dbias, dout, nullptr, nullptr, nullptr, N, OC, S(blas.stream()));
    return Launched("matmul backward (bias)");
  }
  return Status::Ok();
}

Status MatmulForwardBf16(const Blas& blas, float* out, const uint16_t* inp,
                         const uint16_t* weight, int64_t N, int64_t C, int64_t OC) {
  UCP_RETURN_IF_ERROR(Positive("bf16 matmul forward", {N, C, OC}));
  const float alpha = 1.0f, beta = 0.0f;
  return Blased(cublasGemmEx(static_cast<cublasHandle_t>(blas.handle()), CUBLAS_OP_T, CUBLAS_OP_N,
                             static_cast<int>(OC), static_cast<int>(N), static_cast<int>(C),
                             &alpha, weight, CUDA_R_16BF, static_cast<int>(C), inp, CUDA_R_16BF,
                             static_cast<int>(C), &beta, out, CUDA_R_32F, static_cast<int>(OC),
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                "bf16 matmul forward");
}

namespace {

// The bf16 GEMMs run with cuBLAS's default math (tensor cores; bf16 products are exact in fp32
// and the accumulation is fp32); the handle is pedantic for the fp32 GEMMs, whose results must
// stay within the CPU reference's bounds, so the mode is switched for these calls and restored.
class DefaultMath {
 public:
  explicit DefaultMath(cublasHandle_t h) : h_(h) {
    if (cublasGetMathMode(h_, &saved_) != CUBLAS_STATUS_SUCCESS) saved_ = CUBLAS_PEDANTIC_MATH;
    cublasSetMathMode(h_, CUBLAS_DEFAULT_MATH);
  }
  ~DefaultMath() { cublasSetMathMode(h_, saved_); }
  DefaultMath(const DefaultMath&) = delete;
  DefaultMath& operator=(const DefaultMath&) = delete;

 private:
  cublasHandle_t h_;
  cublasMath_t saved_ = CUBLAS_PEDANTIC_MATH;
};

// Column-major C[m, n] = alpha op(A) op(B) + beta C with bf16 A and B, fp32 C.
Status GemmBf16(const Blas& blas, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
                int64_t ldb, float beta, float* c, int64_t ldc, const char* what) {
  auto h = static_cast<cublasHandle_t>(blas.handle());
  const float alpha = 1.0f;
  DefaultMath math(h);
  return Blased(cublasGemmEx(h, ta, tb, static_cast<int>(m), static_cast<int>(n),
                             static_cast<int>(k), &alpha, a, CUDA_R_16BF, static_cast<int>(lda), b,
                             CUDA_R_16BF, static_cast<int>(ldb), &beta, c, CUDA_R_32F,
                             static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                what);
}

}  // namespace

int64_t MixedMatmulScratch(int64_t N, int64_t C, int64_t OC) {
  return gpu::MixedMatmulScratch(N, C, OC);
}

Status MatmulForwardMixed(const Blas& blas, float* out, const float* inp, const uint16_t* weight16,
                          const float* bias, int64_t N, int64_t C, int64_t OC,
                          uint16_t* scratch16) {
  UCP_RETURN_IF_ERROR(Positive("mixed matmul forward", {N, C, OC}));
  if (N == 0) return Status::Ok();
  uint16_t* inp16 = scratch16;
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(inp, inp16, N * C, blas.stream()));
  float beta = 0.0f;
  if (bias) {
    BroadcastRowsKernel<<<Grid(N * OC), kThreads, 0, S(blas.stream())>>>(out, bias, N, OC);
    UCP_RETURN_IF_ERROR(Launched("mixed matmul forward bias"));
    beta = 1.0f;
  }
  // As MatmulForward: out^T[OC, N] = W^T (row-major [OC, C] read transposed) inp^T.
  return GemmBf16(blas, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight16, C, inp16, C, beta, out, OC,
                  "mixed matmul forward");
}

Status MatmulBackwardMixed(const Blas& blas, float* dinp, float* dweight, float* dbias,
                           const float* dout, const float* inp, const uint16_t* weight16,
                           int64_t N, int64_t C, int64_t OC, uint16_t* scratch16) {
  UCP_RETURN_IF_ERROR(Positive("mixed matmul backward", {N, C, OC}));
  if (N == 0) return Status::Ok();
  uint16_t* dout16 = scratch16;
  uint16_t* inp16 = scratch16 + gpu::MixedMatmulInputOffset(N, OC);
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(dout, dout16, N * OC, blas.stream()));
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(inp, inp16, N * C, blas.stream()));
  if (dinp) {
    // dinp^T[C, N] += W^T[C, OC] dout^T[OC, N]
    UCP_RETURN_IF_ERROR(GemmBf16(blas, CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight16, C, dout16,
                                 OC, 1.0f, dinp, C, "mixed matmul backward (input)"));
  }
  // dweight^T[C, OC] += inp^T[C, N] dout[N, OC]
  UCP_RETURN_IF_ERROR(GemmBf16(blas, CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp16, C, dout16, OC,
                               1.0f, dweight, C, "mixed matmul backward (weight)"));
  if (dbias) {
    ColumnGrad(nullptr, dbias, dout, nullptr, nullptr, nullptr, N, OC, S(blas.stream()));
    return Launched("mixed matmul backward (bias)");
  }
  return Status::Ok();
}

// ---- attention through batched GEMMs (bf16 training)

namespace {

// The i-th product reads a[i], b[i] and writes c[i] (device arrays of device pointers).
Status GemmBf16Batched(const Blas& blas, cublasOperation_t ta, cublasOperation_t tb, int64_t m,
                       int64_t n, int64_t k, void* const* a, int64_t lda, void* const* b,
                       int64_t ldb, float beta, void* const* c, int64_t ldc, int64_t count,
                       const char* what) {
  auto h = static_cast<cublasHandle_t>(blas.handle());
  const float alpha = 1.0f;
  DefaultMath math(h);
  return Blased(cublasGemmBatchedEx(h, ta, tb, static_cast<int>(m), static_cast<int>(n),
                                    static_cast<int>(k), &alpha, a, CUDA_R_16BF,
                                    static_cast<int>(lda), b, CUDA_R_16BF, static_cast<int>(ldb),
                                    &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                    static_cast<int>(count), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                what);
}

// The scratch's layout and sizes are offload/model/gpu_sizes.h's (the memory plan counts them).
constexpr int64_t kAlign = gpu::kAttnAlign;
using gpu::AttnLayout;
using gpu::AttnScratch;
int64_t PairBytes(int64_t T, int64_t hd) { return gpu::AttnPairBytes(T, hd); }

// Pointer arrays, one of B NH entries per kind: the per-(sequence, head) operands, then the
// per-pass buffers (the first `pairs` entries).
enum AttnPtr { kQ16, kK16, kV16, kO32, kDO16, kDQ32, kS, kP16, kDP, kDK, kDV, kPtrKinds };
static_assert(kPtrKinds == gpu::kAttnPtrKinds, "gpu_sizes.h counts the pointer arrays");

// The pairs per pass `bytes` of scratch hold: a multiple of the group size (a group's heads
// share one pass, so its dk and dv are summed there), at most B NH.
int64_t AttnPairs(int64_t bytes, int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t hpg = NH / KV;
  const int64_t left = bytes - AttnLayout(B, T, NH, KV, hd, 0).fixed - 5 * kAlign;
  if (left <= 0) return 0;
  return std::min(left / PairBytes(T, hd) / hpg * hpg, B * NH);
}

Status CheckAttentionGemm(const char* what, int64_t B, int64_t T, int64_t NH, int64_t KV,
                          int64_t hd) {
  UCP_RETURN_IF_ERROR(Positive(what, {B, T, NH, KV, hd}));
  if (KV < 1 || NH % KV != 0) {
    return InvalidArgumentError(std::string(what) + ": kv_heads must divide heads");
  }
  return Status::Ok();
}

// The pass plan of one call: the buffers, and the pointer arrays filled (one copy to the
// device, ordered on the stream after the work that read the previous call's).
struct AttnPlan {
  AttnScratch a;
  int64_t pairs = 0, T = 0, hd = 0, row = 0, ah = 0, BNH = 0;
  float scale = 0;
  cudaStream_t st = nullptr;
  void** ptrs = nullptr;  // device: kPtrKinds x B NH
  uint16_t* qkv16 = nullptr;
  uint16_t* dout16 = nullptr;
  float* S32 = nullptr;
  __nv_bfloat16* P16 = nullptr;
  float* dP32 = nullptr;
  float* dK32 = nullptr;
  float* dV32 = nullptr;
  void* const* Kind(AttnPtr k, int64_t p0) const { return ptrs + k * BNH + p0; }
};

// Checks the sizes, lays out the scratch, fills the pointer arrays and rounds qkv to bf16.
Result<AttnPlan> PlanAttention(const char* what, const Blas& blas, void* scratch, int64_t bytes,
                               const float* qkv, float* out, float* dqkv, int64_t B, int64_t T,
                               int64_t NH, int64_t KV, int64_t hd) {
  UCP_RETURN_IF_ERROR(CheckAttentionGemm(what, B, T, NH, KV, hd));
  AttnPlan p;
  p.st = S(blas.stream());
  p.T = T, p.hd = hd, p.row = (NH + 2 * KV) * hd, p.ah = NH * hd, p.BNH = B * NH;
  p.scale = 1.0f / sqrtf(static_cast<float>(hd));
  p.pairs = AttnPairs(bytes, B, T, NH, KV, hd);
  if (p.pairs < NH / KV) {
    return InvalidArgumentError(std::string(what) + ": " + std::to_string(bytes) +
                                " bytes of scratch hold less than one pass (AttentionGemmScratchBytes)");
  }
  p.a = AttnLayout(B, T, NH, KV, hd, p.pairs);
  char* base = static_cast<char*>(scratch);
  p.qkv16 = reinterpret_cast<uint16_t*>(base + p.a.qkv16);
  p.dout16 = reinterpret_cast<uint16_t*>(base + p.a.dout16);
  p.ptrs = reinterpret_cast<void**>(base + p.a.ptrs);
  p.S32 = reinterpret_cast<float*>(base + p.a.S);
  p.P16 = reinterpret_cast<__nv_bfloat16*>(base + p.a.P16);
  p.dP32 = reinterpret_cast<float*>(base + p.a.dP);
  p.dK32 = reinterpret_cast<float*>(base + p.a.dK);
  p.dV32 = reinterpret_cast<float*>(base + p.a.dV);
  const int64_t ah = p.ah;
  const QkvLayout L{NH / KV, hd, p.row};
  std::vector<void*> h(static_cast<size_t>(kPtrKinds * p.BNH), nullptr);
  auto at = [&](AttnPtr k, int64_t i) -> void*& { return h[static_cast<size_t>(k * p.BNH + i)]; };
  for (int64_t bh = 0; bh < p.BNH; ++bh) {
    const int64_t b = bh / NH, hh = bh % NH, g = hh / L.hpg;
    at(kQ16, bh) = p.qkv16 + b * T * L.row + L.Q(hh);
    at(kK16, bh) = p.qkv16 + b * T * L.row + L.K(g);
    at(kV16, bh) = p.qkv16 + b * T * L.row + L.V(g);
    at(kO32, bh) = out ? out + b * T * ah + hh * hd : nullptr;
    at(kDO16, bh) = p.dout16 + b * T * ah + hh * hd;
    at(kDQ32, bh) = dqkv ? dqkv + b * T * L.row + L.Q(hh) : nullptr;
  }
  for (int64_t i = 0; i < p.pairs; ++i) {
    at(kS, i) = p.S32 + i * T * T;
    at(kP16, i) = p.P16 + i * T * T;
    at(kDP, i) = p.dP32 + i * T * T;
    at(kDK, i) = p.dK32 + i * T * hd;
    at(kDV, i) = p.dV32 + i * T * hd;
  }
  // Pageable source: the call returns once the pointers are staged, so h may go.
  if (cudaMemcpyAsync(p.ptrs, h.data(), h.size() * sizeof(void*), cudaMemcpyHostToDevice,
                      p.st) != cudaSuccess) {
    return Launched("attention pointer arrays");
  }
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(qkv, p.qkv16, B * T * p.row, p.st));
  return p;
}

// Pairs [p0, p0 + n): the scores S_i[t, j] = q_t . k_j (row-major T x T: column-major k q^T),
// then the causal softmax (forward: lse_out written; backward: from lse_in).
Status Probabilities(const Blas& blas, const AttnPlan& p, int64_t p0, int64_t n, float* lse_out,
                     const float* lse_in) {
  UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_T, CUBLAS_OP_N, p.T, p.T, p.hd,
                                      p.Kind(kK16, p0), p.row, p.Kind(kQ16, p0), p.row, 0.0f,
                                      p.Kind(kS, 0), p.T, n, "attention scores"));
  CausalSoftmaxKernel<<<static_cast<unsigned>(n * p.T), kThreads, 0, p.st>>>(
      p.S32, p.P16, lse_out, lse_in, p.T, p0, p.scale);
  return Launched("attention softmax");
}

}  // namespace

int64_t AttentionGemmScratchBytes(int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                  int64_t pairs_per_pass) {
  return gpu::AttentionGemmScratchBytes(B, T, NH, KV, hd, pairs_per_pass);
}

Status AttentionForwardGemm(const Blas& blas, float* out, float* lse, const float* qkv, int64_t B,
                            int64_t T, int64_t NH, int64_t KV, int64_t hd, void* scratch,
                            int64_t scratch_bytes) {
  if (B * T == 0) return CheckAttentionGemm("gemm attention forward", B, T, NH, KV, hd);
  UCP_ASSIGN_OR_RETURN(AttnPlan p, PlanAttention("gemm attention forward", blas, scratch,
                                                 scratch_bytes, qkv, out, nullptr, B, T, NH, KV,
                                                 hd));
  for (int64_t p0 = 0; p0 < p.BNH; p0 += p.pairs) {
    const int64_t n = std::min(p.pairs, p.BNH - p0);
    UCP_RETURN_IF_ERROR(Probabilities(blas, p, p0, n, lse, nullptr));
    // out_t = sum_j P[t, j] v_j (column-major v^T P^T)
    UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, T, T,
                                        p.Kind(kV16, p0), p.row, p.Kind(kP16, 0), T, 0.0f,
                                        p.Kind(kO32, p0), p.ah, n, "attention output"));
  }
  return Status::Ok();
}

Status AttentionBackwardGemm(const Blas& blas, float* dqkv, const float* dout, const float* qkv,
                             const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                             int64_t hd, void* scratch, int64_t scratch_bytes) {
  if (B * T == 0) return CheckAttentionGemm("gemm attention backward", B, T, NH, KV, hd);
  UCP_ASSIGN_OR_RETURN(AttnPlan p, PlanAttention("gemm attention backward", blas, scratch,
                                                 scratch_bytes, qkv, nullptr, dqkv, B, T, NH, KV,
                                                 hd));
  const QkvLayout L{NH / KV, hd, p.row};
  UCP_RETURN_IF_ERROR(CastFp32ToBf16(dout, p.dout16, B * T * p.ah, p.st));
  for (int64_t p0 = 0; p0 < p.BNH; p0 += p.pairs) {
    const int64_t n = std::min(p.pairs, p.BNH - p0);
    // The probabilities again, from the forward's log-sum-exp.
    UCP_RETURN_IF_ERROR(Probabilities(blas, p, p0, n, nullptr, lse));
    // dv_j (per head) = sum_t P[t, j] dout_t
    UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_N, CUBLAS_OP_T, hd, T, T,
                                        p.Kind(kDO16, p0), p.ah, p.Kind(kP16, 0), T, 0.0f,
                                        p.Kind(kDV, 0), hd, n, "attention dv"));
    // dP[t, j] = dout_t . v_j
    UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hd,
                                        p.Kind(kV16, p0), p.row, p.Kind(kDO16, p0), p.ah, 0.0f,
                                        p.Kind(kDP, 0), T, n, "attention dP"));
    // dS = P (dP - rowsum(P dP)) scale, in bf16 over P16 (dv has read it)
    SoftmaxBackwardKernel<<<static_cast<unsigned>(n * T), kThreads, 0, p.st>>>(
        p.P16, p.S32, p.dP32, T, p.scale);
    UCP_RETURN_IF_ERROR(Launched("attention softmax backward"));
    // dq_t += sum_j dS[t, j] k_j, straight into dqkv (each pair its own head's slot)
    UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_N, CUBLAS_OP_N, hd, T, T,
                                        p.Kind(kK16, p0), p.row, p.Kind(kP16, 0), T, 1.0f,
                                        p.Kind(kDQ32, p0), p.row, n, "attention dq"));
    // dk_j (per head) = sum_t dS[t, j] q_t
    UCP_RETURN_IF_ERROR(GemmBf16Batched(blas, CUBLAS_OP_N, CUBLAS_OP_T, hd, T, T,
                                        p.Kind(kQ16, p0), p.row, p.Kind(kP16, 0), T, 0.0f,
                                        p.Kind(kDK, 0), hd, n, "attention dk"));
    GroupKvGradKernel<<<Grid(n / L.hpg * T * hd), kThreads, 0, p.st>>>(
        dqkv, p.dK32, p.dV32, n, T, NH, L, p0);
    UCP_RETURN_IF_ERROR(Launched("attention dk dv"));
  }
  return Status::Ok();
}

Status AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                        int64_t NH, int64_t KV, int64_t hd, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("attention forward", {B, T, NH, KV, hd}));
  if (KV < 1 || NH % KV != 0 || hd > kWarp * kMaxHdPerLane) {
    return InvalidArgumentError("attention forward: heads=" + std::to_string(NH) +
                                ", kv_heads=" + std::to_string(KV) + ", head_dim=" +
                                std::to_string(hd) + " (kv_heads must divide heads, head_dim <= " +
                                std::to_string(kWarp * kMaxHdPerLane) + ")");
  }
  AttentionForwardKernel<<<Grid(B * NH * T * kWarp), kThreads, 0, S(stream)>>>(out, lse, qkv, B, T,
                                                                               NH, KV, hd);
  return Launched("attention forward");
}

int64_t AttentionBackwardScratch(int64_t B, int64_t T, int64_t NH) {
  return gpu::AttentionBackwardScratch(B, T, NH);
}

void SetMaxGridBlocksForTest(int blocks) {
  max_grid_blocks = blocks > 0 ? std::min(blocks, kMaxGridBlocks) : kMaxGridBlocks;
}

Status AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                         float* scratch, int64_t B, int64_t T, int64_t NH, int64_t KV,
                         int64_t hd, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("attention backward", {B, T, NH, KV, hd}));
  if (KV < 1 || NH % KV != 0 || hd > kWarp * kMaxHdPerLane) {
    return InvalidArgumentError("attention backward: heads=" + std::to_string(NH) +
                                ", kv_heads=" + std::to_string(KV) + ", head_dim=" +
                                std::to_string(hd));
  }
  AttentionBackwardQueryKernel<<<Grid(B * NH * T * kWarp), kThreads, 0, S(stream)>>>(
      dqkv, scratch, dout, qkv, lse, B, T, NH, KV, hd);
  UCP_RETURN_IF_ERROR(Launched("attention backward (queries)"));
  AttentionBackwardKeyKernel<<<Grid(B * KV * T * kWarp), kThreads, 0, S(stream)>>>(
      dqkv, scratch, dout, qkv, lse, B, T, NH, KV, hd);
  return Launched("attention backward (keys)");
}

Status RopeForward(float* qkv, const float* cos_table, const float* sin_table, int64_t B,
                   int64_t T, int64_t NH, int64_t KV, int64_t hd, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("rope forward", {B, T, NH, KV, hd}));
  if (KV < 1 || NH % KV != 0 || hd % 2 != 0) return InvalidArgumentError("rope: heads/kv/hd");
  RopeKernel<<<Grid(B * T * NH * hd), kThreads, 0, S(stream)>>>(qkv, cos_table, sin_table, B, T, NH,
                                                                KV, hd, 1.0f);
  return Launched("rope forward");
}

Status RopeBackward(float* dqkv, const float* cos_table, const float* sin_table, int64_t B,
                    int64_t T, int64_t NH, int64_t KV, int64_t hd, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("rope backward", {B, T, NH, KV, hd}));
  if (KV < 1 || NH % KV != 0 || hd % 2 != 0) return InvalidArgumentError("rope: heads/kv/hd");
  RopeKernel<<<Grid(B * T * NH * hd), kThreads, 0, S(stream)>>>(dqkv, cos_table, sin_table, B, T,
                                                                NH, KV, hd, -1.0f);
  return Launched("rope backward");
}

Status GeluForward(float* out, const float* inp, int64_t n, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("gelu forward", {n}));
  GeluForwardKernel<<<Grid(n), kThreads, 0, S(stream)>>>(out, inp, n);
  return Launched("gelu forward");
}

Status GeluBackward(float* dinp, const float* inp, const float* dout, int64_t n, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("gelu backward", {n}));
  GeluBackwardKernel<<<Grid(n), kThreads, 0, S(stream)>>>(dinp, inp, dout, n);
  return Launched("gelu backward");
}

Status SwigluForward(float* out, const float* inp, int64_t N, int64_t F, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("swiglu forward", {N, F}));
  SwigluForwardKernel<<<Grid(N * F), kThreads, 0, S(stream)>>>(out, inp, N, F);
  return Launched("swiglu forward");
}

Status SwigluBackward(float* dinp, const float* inp, const float* dout, int64_t N, int64_t F,
                      void* stream) {
  UCP_RETURN_IF_ERROR(Positive("swiglu backward", {N, F}));
  SwigluBackwardKernel<<<Grid(N * F), kThreads, 0, S(stream)>>>(dinp, inp, dout, N, F);
  return Launched("swiglu backward");
}

Status ResidualForward(float* out, const float* a, const float* b, int64_t n, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("residual forward", {n}));
  ResidualForwardKernel<<<Grid(n), kThreads, 0, S(stream)>>>(out, a, b, n);
  return Launched("residual forward");
}

Status ResidualBackward(float* da, float* db, const float* dout, int64_t n, void* stream) {
  UCP_RETURN_IF_ERROR(Positive("residual backward", {n}));
  ResidualBackwardKernel<<<Grid(n), kThreads, 0, S(stream)>>>(da, db, dout, n);
  return Launched("residual backward");
}

Status GradNormChunks(const float* x, int64_t n, int64_t chunk, double* partial, float* maxabs,
                      void* stream) {
  UCP_RETURN_IF_ERROR(Positive("gradient norm", {n}));
  if (chunk <= 0 || chunk % 8 != 0) {
    return InvalidArgumentError("gradient norm: chunks of " + std::to_string(chunk) +
                                " elements (a positive multiple of 8)");
  }
  if (n == 0) return Status::Ok();
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t blocks = (chunks * 8 + kThreads - 1) / kThreads;
  GradNormChunksKernel<<<static_cast<unsigned>(blocks), kThreads, 0, S(stream)>>>(
      x, n, chunk, chunks, partial, maxabs);
  return Launched("gradient norm");
}

int64_t ClassifierScratch(int64_t N, int64_t V, int64_t most_rows) {
  // a block's logits, then N doubles (2 floats each, 8-byte aligned), then the bad-target flag.
  return gpu::ClassifierScratch(N, V, most_rows);
}

Result<double> ClassifierForwardBackward(const Blas& blas, float* dx, float* dw, const float* x,
                                         const float* w, const int32_t* targets, float* scratch,
                                         int64_t N, int64_t C, int64_t V, float grad_scale,
                                         const uint16_t* w16, uint16_t* scratch16,
                                         int64_t most_rows) {
  UCP_RETURN_IF_ERROR(Positive("classifier", {N, C, V}));
  if (w16 != nullptr && scratch16 == nullptr) {
    return InvalidArgumentError("classifier: bf16 weights without bf16 scratch");
  }
  if (most_rows < 0) {
    return InvalidArgumentError("classifier: most_rows " + std::to_string(most_rows) + " < 0");
  }
  if (N == 0) return 0.0;
  const int64_t R = gpu::ClassifierBlockRows(N, V, most_rows);
  float* logits = scratch;  // [R, V]
  double* row_loss = reinterpret_cast<double*>(scratch + ((R * V + 1) / 2) * 2);
  int* bad = reinterpret_cast<int*>(row_loss + N);
  cudaStream_t st = S(blas.stream());
  if (cudaMemsetAsync(bad, 0, sizeof(int), st) != cudaSuccess) return Launched("classifier flag");
  int bad_host = 0;
  auto refused = [&]() -> Status {
    if (cudaMemcpyAsync(&bad_host, bad, sizeof(int), cudaMemcpyDeviceToHost, st) != cudaSuccess ||
        cudaStreamSynchronize(st) != cudaSuccess) {
      return Launched("classifier target check");
    }
    if (bad_host != 0) {
      return InvalidArgumentError("classifier: a target >= the vocabulary of " +
                                  std::to_string(V));
    }
    return Status::Ok();
  };
  if (dx != nullptr) {
    // Every block's targets before any block adds its gradient: a bad one in a later block
    // must not leave the earlier blocks' gradients added to dx and dw.
    CheckTargetsKernel<<<Grid(N), kThreads, 0, st>>>(targets, N, V, bad);
    UCP_RETURN_IF_ERROR(Launched("classifier target check"));
    UCP_RETURN_IF_ERROR(refused());
  }
  for (int64_t r0 = 0; r0 < N; r0 += R) {
    const int64_t rows = std::min(R, N - r0);
    const float* xb = x + r0 * C;
    UCP_RETURN_IF_ERROR(w16 ? MatmulForwardMixed(blas, logits, xb, w16, nullptr, rows, C, V,
                                                 scratch16)
                            : MatmulForward(blas, logits, xb, w, nullptr, rows, C, V));
    CrossEntropyKernel<<<static_cast<unsigned>(rows), kThreads, 0, st>>>(
        logits, row_loss + r0, bad, targets + r0, V, grad_scale, dx != nullptr);
    UCP_RETURN_IF_ERROR(Launched("classifier cross-entropy"));
    if (dx != nullptr) {
      UCP_RETURN_IF_ERROR(w16 ? MatmulBackwardMixed(blas, dx + r0 * C, dw, nullptr, logits, xb,
                                                    w16, rows, C, V, scratch16)
                              : MatmulBackward(blas, dx + r0 * C, dw, nullptr, logits, xb, w,
                                               rows, C, V));
    }
  }
  std::vector<double> losses(static_cast<size_t>(N));
  if (cudaMemcpyAsync(losses.data(), row_loss, sizeof(double) * N, cudaMemcpyDeviceToHost, st) !=
      cudaSuccess) {
    return Launched("classifier loss copy");
  }
  UCP_RETURN_IF_ERROR(refused());  // (also waits for the losses)
  double loss = 0.0;
  for (double l : losses) loss += l;  // row order, as the CPU reference
  return loss;
}

}  // namespace ucp::offload::cuda
