// Test-only: just enough of CUDA's SIMT model, on host threads, to run the kernel headers'
// kernels (cuda_platform.h) on a CPU (kernels_emulated_test.cc), where CI runs without a GPU.
// A block's threads are real threads (std::thread) sharing one buffer of "shared memory";
// __syncthreads, __syncwarp and __shfl_xor_sync are barriers; blocks run one after another.
// WMMA fragments hold 8 of the 256 elements per lane, scattered by a different permutation for
// each fragment kind, so a kernel that assumed a layout WMMA does not promise (beyond
// accumulators sharing theirs) gets wrong answers here. An operand fragment also keeps the whole
// matrix its lane loaded (hidden from kernels), so mma_sync needs no exchange between lanes: it
// multiplies the bf16 operands exactly and accumulates in fp32.
// cp.async (__pipeline_memcpy_async) takes the latest a GPU may: the destination reads as NaN
// bytes from the issue until a __pipeline_wait_prior of the issuing thread covers its group,
// which then copies; so a read before the wait, or a copy issued into a buffer another warp still
// reads, shows in the results.
// The WMMA rules a GPU faults or misbehaves on (fragment pointers 32-byte aligned, ldm a
// multiple of 8 bf16 or 4 floats) are checked and recorded in simt::Violations(). Shared memory
// starts as 0xFF bytes (NaNs), so reading what no thread wrote shows in the results.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "ucp/tensor/float_bits.h"

#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)

struct __nv_bfloat16 {
  uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {ucp::Bf16FromFloat(f)}; }

struct uint4 {
  unsigned x, y, z, w;
};

namespace simt {
struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
}  // namespace simt

inline thread_local simt::Dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace simt {

struct Warp {
  std::unique_ptr<std::barrier<>> bar;
  float shfl[32];
};

struct Block {
  std::vector<unsigned char> storage;
  unsigned char* smem = nullptr;  // 128-byte aligned, as CUDA's dynamic shared memory
  std::unique_ptr<std::barrier<>> bar;
  std::vector<Warp> warps;
};

inline thread_local Block* current = nullptr;

inline std::mutex& ViolationMutex() {
  static std::mutex m;
  return m;
}
inline std::vector<std::string>& ViolationList() {
  static std::vector<std::string> v;
  return v;
}
inline void Violation(const std::string& what) {
  std::lock_guard<std::mutex> lock(ViolationMutex());
  if (ViolationList().size() < 16) ViolationList().push_back(what);
}
/// The WMMA rules broken so far (and clears them).
inline std::vector<std::string> Violations() {
  std::lock_guard<std::mutex> lock(ViolationMutex());
  return std::exchange(ViolationList(), {});
}

inline unsigned char* DynamicSmem() { return current->smem; }
inline Warp& MyWarp() { return current->warps[threadIdx.x / 32]; }
inline int Lane() { return static_cast<int>(threadIdx.x % 32); }

/// Runs kernel<<<grid, threads, smem_bytes>>>(args...): each block's threads at once, the
/// blocks in turn.
template <typename... P, typename... A>
void Launch(void (*kernel)(P...), Dim3 grid, unsigned threads, size_t smem_bytes, A... args) {
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Block blk;
        blk.storage.assign(smem_bytes + 128, 0xFF);
        blk.smem = blk.storage.data() + (128 - reinterpret_cast<uintptr_t>(blk.storage.data()) % 128);
        blk.bar = std::make_unique<std::barrier<>>(threads);
        blk.warps.resize(threads / 32);
        for (Warp& w : blk.warps) w.bar = std::make_unique<std::barrier<>>(32);
        std::vector<std::thread> ts;
        ts.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
          ts.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            blockIdx = {x, y, z};
            blockDim = {threads, 1, 1};
            gridDim = grid;
            current = &blk;
            kernel(args...);
          });
        }
        for (auto& th : ts) th.join();
      }
    }
  }
}

}  // namespace simt

namespace simt {
struct Copy {
  void* dst;
  const void* src;
  size_t n;
};
inline thread_local std::vector<Copy> open_group;
inline thread_local std::deque<std::vector<Copy>> committed;
}  // namespace simt

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t n) {
  if ((n != 4 && n != 8 && n != 16) || reinterpret_cast<uintptr_t>(dst) % n != 0 ||
      reinterpret_cast<uintptr_t>(src) % n != 0) {
    simt::Violation("__pipeline_memcpy_async: " + std::to_string(n) + " bytes, misaligned or odd");
  }
  std::memset(dst, 0xFF, n);
  simt::open_group.push_back({dst, src, n});
}
inline void __pipeline_commit() {
  simt::committed.push_back(std::move(simt::open_group));
  simt::open_group.clear();
}
inline void __pipeline_wait_prior(size_t n) {
  while (simt::committed.size() > n) {
    for (const simt::Copy& c : simt::committed.front()) std::memcpy(c.dst, c.src, c.n);
    simt::committed.pop_front();
  }
}

inline void __syncthreads() { simt::current->bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { simt::MyWarp().bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  simt::Warp& w = simt::MyWarp();
  const int lane = simt::Lane();
  w.shfl[lane] = v;
  w.bar->arrive_and_wait();
  const float r = w.shfl[lane ^ lane_mask];
  w.bar->arrive_and_wait();
  return r;
}

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation has 16 x 16 x 16 only");
  static constexpr int num_elements = 8;
  T x[8];
  // Operands: the whole matrix as loaded (mma_sync's), in fp32 (bf16 widens exactly).
  float full[std::is_same_v<Use, accumulator> ? 1 : 256];
};

namespace detail {

// Element i of `lane`'s fragment is element Place(lane, i) = 16 r + c of the matrix: an odd
// multiplier and an offset make each kind's map a different bijection of 0..255.
template <typename Use>
int Place(int lane, int i) {
  constexpr int mul = std::is_same_v<Use, matrix_a> ? 37 : std::is_same_v<Use, matrix_b> ? 101 : 59;
  constexpr int add = std::is_same_v<Use, matrix_a> ? 11 : std::is_same_v<Use, matrix_b> ? 200 : 77;
  return ((lane * 8 + i) * mul + add) % 256;
}

inline float ToFloat(float v) { return v; }
inline float ToFloat(__nv_bfloat16 v) { return ucp::FloatFromBf16(v.bits); }

template <typename T>
void CheckOperand(const T* p, unsigned ldm, const char* what) {
  constexpr unsigned unit = sizeof(T) == 2 ? 8 : 4;
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) {
    simt::Violation(std::string(what) + ": pointer not 32-byte aligned");
  }
  if (ldm % unit != 0) simt::Violation(std::string(what) + ": ldm " + std::to_string(ldm));
}

}  // namespace detail

template <typename Use, typename T, typename Layout>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* p, unsigned ldm) {
  static_assert(!std::is_same_v<Use, accumulator>, "accumulators load with a layout_t");
  detail::CheckOperand(p, ldm, "load_matrix_sync");
  for (int e = 0; e < 256; ++e) {
    const int r = e / 16, c = e % 16;
    f.full[e] =
        detail::ToFloat(std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r]);
  }
  for (int i = 0; i < 8; ++i) {
    const int e = detail::Place<Use>(simt::Lane(), i), r = e / 16, c = e % 16;
    f.x[i] = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
  }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t l) {
  detail::CheckOperand(p, ldm, "load_matrix_sync (accumulator)");
  for (int i = 0; i < 8; ++i) {
    const int e = detail::Place<accumulator>(simt::Lane(), i), r = e / 16, c = e % 16;
    f.x[i] = l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  }
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t l) {
  detail::CheckOperand(p, ldm, "store_matrix_sync");
  for (int i = 0; i < 8; ++i) {
    const int e = detail::Place<accumulator>(simt::Lane(), i), r = e / 16, c = e % 16;
    (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[i];
  }
}

template <typename Use, typename T, typename Layout>
void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, T v) {
  for (T& x : f.x) x = v;
}

// d = a b + c: each lane its own accumulator elements (k in order, fp32), from the operands'
// whole matrices.
template <typename LA, typename LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
              const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
              const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
              const fragment<accumulator, 16, 16, 16, float>& c) {
  const int lane = simt::Lane();
  for (int i = 0; i < 8; ++i) {
    const int e = detail::Place<accumulator>(lane, i), r = e / 16, col = e % 16;
    float acc = c.x[i];
    for (int k = 0; k < 16; ++k) acc += a.full[r * 16 + k] * b.full[k * 16 + col];
    d.x[i] = acc;
  }
}

}  // namespace nvcuda::wmma
