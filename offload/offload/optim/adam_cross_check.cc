// A standalone check that the fp32 Adam paths agree bitwise within one machine and across
// architectures: it steps fixed problems (every grad/out dtype, amsgrad, L2, snapshot, sizes with
// vector tails) with each path this CPU runs, fails if any two differ, and prints one FNV-1a hash
// per case. offload/cross_check.sh builds it for x86-64 and (with aarch64-linux-gnu-g++) for
// AArch64 and runs the latter under qemu-aarch64 with SVE at several vector lengths; the hashes
// must be equal line for line. Built from the kernel sources only (no ucp libraries).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {
namespace {

using Kernel = void (*)(const AdamStepScalars&, const AdamKernelArgs&);

struct Named {
  const char* name;
  Kernel kernel;
};

std::vector<Named> Kernels() {
  std::vector<Named> k = {{"portable", AdamKernelPortable}};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    k.push_back({"avx2", AdamKernelAvx2});
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    k.push_back({"avx512", AdamKernelAvx512});
  }
#elif defined(__aarch64__)
  k.push_back({"neon", AdamKernelNeon});
  if (getauxval(AT_HWCAP) & HWCAP_SVE) k.push_back({"sve", AdamKernelSve});
#endif
  return k;
}

uint64_t Fnv(uint64_t h, const void* data, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

// Deterministic data without <random> (its distributions differ between standard libraries).
float Value(uint64_t& s, float scale) {
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  const int32_t x = static_cast<int32_t>(s >> 32);
  return static_cast<float>(x) * (scale / 2147483648.0f);
}

struct Problem {
  std::vector<float> p, m, v, vmax, g32, sp, sm, sv, svmax;
  std::vector<uint16_t> g16, out;
  Problem(size_t n, uint64_t seed, LowpDType gd) {
    for (auto* x : {&p, &m, &v, &vmax, &g32, &sp, &sm, &sv, &svmax}) x->assign(n, 0.f);
    g16.assign(n, 0);
    out.assign(n, 0);
    for (size_t i = 0; i < n; ++i) {
      p[i] = Value(seed, 1.0f);
      g32[i] = Value(seed, 0.05f);
      g16[i] = gd == LowpDType::kBf16 ? Bf16BitsRne(g32[i]) : Fp16BitsRne(g32[i]);
      m[i] = Value(seed, 0.01f);
      const float r = Value(seed, 0.01f);
      v[i] = r * r;
      vmax[i] = (i % 2) ? v[i] * 2.f : v[i] * 0.5f;
    }
  }
  AdamKernelArgs Args(LowpDType gd, LowpDType od, bool ams, bool l2, bool snap) {
    AdamKernelArgs a;
    a.p = p.data();
    a.g = gd == LowpDType::kFp32 ? static_cast<const void*>(g32.data()) : g16.data();
    a.m = m.data();
    a.v = v.data();
    a.vmax = ams ? vmax.data() : nullptr;
    a.out = od == LowpDType::kFp32 ? nullptr : out.data();
    if (snap) {
      a.snap_p = sp.data();
      a.snap_m = sm.data();
      a.snap_v = sv.data();
      a.snap_vmax = ams ? svmax.data() : nullptr;
    }
    a.n = p.size();
    a.grad_dtype = gd;
    a.out_dtype = od;
    a.amsgrad = ams;
    a.l2 = l2;
    a.snapshot = snap;
    return a;
  }
  uint64_t Hash() const {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const auto* x : {&p, &m, &v, &vmax, &sp, &sm, &sv, &svmax})
      h = Fnv(h, x->data(), x->size() * 4);
    return Fnv(h, out.data(), out.size() * 2);
  }
};

int Run() {
  // Scalars as MakeAdamStepScalars gives them for lr 1e-3, wd 0.1 (AdamW and L2), step 3.
  AdamStepScalars s{};
  s.beta1 = 0.9f;
  s.one_minus_beta1 = 0.1f;
  s.beta2 = 0.999f;
  s.one_minus_beta2 = 1.0f - 0.999f;
  s.eps = 1e-8f;
  s.neg_step_size = -1e-3f / 0.271f;
  s.inv_sqrt_bias2 = 18.2757f;
  const std::vector<Named> kernels = Kernels();
  std::string names;
  for (const Named& k : kernels) names += std::string(" ") + k.name;
  std::fprintf(stderr, "cross check paths:%s\n", names.c_str());
  const LowpDType dts[] = {LowpDType::kFp32, LowpDType::kBf16, LowpDType::kFp16};
  int failures = 0;
  for (size_t n : {size_t{1}, size_t{7}, size_t{17}, size_t{33}, size_t{1025}}) {
    for (LowpDType gd : dts) {
      for (LowpDType od : dts) {
        for (int flags = 0; flags < 8; ++flags) {
          const bool ams = flags & 1, l2 = flags & 2, snap = flags & 4;
          s.l2_weight_decay = l2 ? 0.1f : 0.0f;
          s.decay = l2 ? 1.0f : 1.0f - 1e-4f;
          s.amsgrad = ams;
          uint64_t first = 0;
          for (size_t k = 0; k < kernels.size(); ++k) {
            Problem pr(n, n * 97 + static_cast<uint64_t>(gd) * 13 + static_cast<uint64_t>(od), gd);
            kernels[k].kernel(s, pr.Args(gd, od, ams, l2, snap));
            const uint64_t h = pr.Hash();
            if (k == 0) {
              first = h;
              std::printf("n=%zu grad=%d out=%d ams=%d l2=%d snap=%d %016llx\n", n,
                          static_cast<int>(gd), static_cast<int>(od), ams, l2, snap,
                          static_cast<unsigned long long>(h));
            } else if (h != first) {
              ++failures;
              std::fprintf(stderr, "MISMATCH %s vs %s: n=%zu grad=%d out=%d ams=%d l2=%d snap=%d\n",
                           kernels[k].name, kernels[0].name, n, static_cast<int>(gd),
                           static_cast<int>(od), ams, l2, snap);
            }
          }
        }
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ucp::offload::internal

int main() { return ucp::offload::internal::Run(); }
