// AdamStep and friends: hyper-parameter and span validation, the per-step scalars, and the
// run-time choice of a SIMD path by CPU features.
#include "offload/optim/adam.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "offload/optim/adam_kernel.h"
#include "ucp/base/check.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload {
namespace {

size_t ElementBytes(LowpDType d) { return d == LowpDType::kFp32 ? 4 : 2; }

Status CheckUnit(const char* field, float value, bool below_one) {
  if (!std::isfinite(value) || value < 0.0f || (below_one && value >= 1.0f)) {
    return InvalidArgumentError("adam config: " + std::string(field) + " is " +
                                std::to_string(value) + ", must be " +
                                (below_one ? "in [0, 1)" : "finite and >= 0"));
  }
  return Status::Ok();
}

// One buffer the kernel touches, for the size and overlap checks.
struct Region {
  const char* name;
  const void* data;
  size_t elems;
  size_t bytes;
};

Status CheckRegions(const std::vector<Region>& regions, size_t n) {
  for (const Region& r : regions) {
    if (r.elems != n) {
      return InvalidArgumentError("adam spans: " + std::string(r.name) + " has " +
                                  std::to_string(r.elems) + " elements, param has " +
                                  std::to_string(n));
    }
    if (n != 0 && r.data == nullptr) {
      return InvalidArgumentError("adam spans: " + std::string(r.name) + " is null with " +
                                  std::to_string(n) + " elements");
    }
  }
  if (n == 0) return Status::Ok();
  for (size_t i = 0; i < regions.size(); ++i) {
    for (size_t j = i + 1; j < regions.size(); ++j) {
      const auto a = reinterpret_cast<uintptr_t>(regions[i].data);
      const auto b = reinterpret_cast<uintptr_t>(regions[j].data);
      if (a < b + regions[j].bytes && b < a + regions[i].bytes) {
        return InvalidArgumentError("adam spans: " + std::string(regions[i].name) + " and " +
                                    regions[j].name + " overlap (" +
                                    std::to_string(regions[i].bytes) + " and " +
                                    std::to_string(regions[j].bytes) + " bytes)");
      }
    }
  }
  return Status::Ok();
}

bool CpuHas(SimdPath path) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (path) {
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    default:
      return false;
  }
#else
  (void)path;
  return false;
#endif
}

}  // namespace

Status ValidateAdamConfig(const AdamConfig& c) {
  UCP_RETURN_IF_ERROR(CheckUnit("lr", c.lr, false));
  UCP_RETURN_IF_ERROR(CheckUnit("beta1", c.beta1, true));
  UCP_RETURN_IF_ERROR(CheckUnit("beta2", c.beta2, true));
  UCP_RETURN_IF_ERROR(CheckUnit("eps", c.eps, false));
  UCP_RETURN_IF_ERROR(CheckUnit("weight_decay", c.weight_decay, false));
  return Status::Ok();
}

std::string_view LowpDTypeName(LowpDType dtype) {
  switch (dtype) {
    case LowpDType::kFp32:
      return "fp32";
    case LowpDType::kBf16:
      return "bf16";
    case LowpDType::kFp16:
      return "fp16";
  }
  return "?";
}

GradSpan GradSpan::Sub(size_t offset, size_t count) const {
  return {dtype, static_cast<const std::byte*>(data) + offset * ElementBytes(dtype), count};
}

static std::span<float> SubOrEmpty(std::span<float> s, size_t offset, size_t count) {
  return s.empty() ? s : s.subspan(offset, count);
}

AdamSpans AdamSpans::Sub(size_t offset, size_t count) const {
  AdamSpans r = *this;
  r.param = param.subspan(offset, count);
  r.grad = grad.Sub(offset, count);
  r.exp_avg = exp_avg.subspan(offset, count);
  r.exp_avg_sq = exp_avg_sq.subspan(offset, count);
  r.max_exp_avg_sq = SubOrEmpty(max_exp_avg_sq, offset, count);
  if (!out.data.empty()) r.out.data = out.data.subspan(offset, count);
  return r;
}

AdamSnapshot AdamSnapshot::Sub(size_t offset, size_t count) const {
  return {param.subspan(offset, count), exp_avg.subspan(offset, count),
          exp_avg_sq.subspan(offset, count), SubOrEmpty(max_exp_avg_sq, offset, count)};
}

std::string_view SimdPathName(SimdPath path) {
  switch (path) {
    case SimdPath::kScalarRef:
      return "ref";
    case SimdPath::kPortable:
      return "portable";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
    case SimdPath::kNeon:
      return "neon";
    case SimdPath::kSve:
      return "sve";
  }
  return "?";
}

Result<SimdPath> ParseSimdPath(std::string_view name) {
  for (SimdPath p : {SimdPath::kScalarRef, SimdPath::kPortable, SimdPath::kAvx2, SimdPath::kAvx512,
                     SimdPath::kNeon, SimdPath::kSve}) {
    if (SimdPathName(p) == name) return p;
  }
  return InvalidArgumentError("simd path '" + std::string(name) +
                              "' is not one of ref, portable, avx2, avx512, neon, sve");
}

bool SimdPathAvailable(SimdPath path) {
  switch (path) {
    case SimdPath::kScalarRef:
    case SimdPath::kPortable:
      return true;
    case SimdPath::kAvx2:
#ifdef UCP_OFFLOAD_HAVE_AVX2
      return CpuHas(path);
#else
      return false;
#endif
    case SimdPath::kAvx512:
#ifdef UCP_OFFLOAD_HAVE_AVX512
      return CpuHas(path);
#else
      return false;
#endif
    case SimdPath::kNeon:
#ifdef UCP_OFFLOAD_HAVE_NEON
      return true;  // Advanced SIMD is part of the AArch64 baseline
#else
      return false;
#endif
    case SimdPath::kSve:
#ifdef UCP_OFFLOAD_HAVE_SVE
      return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;  // GCC 12 has no aarch64 cpu_supports
#else
      return false;
#endif
  }
  return false;
}

SimdPath BestSimdPath() {
  for (SimdPath p : {SimdPath::kAvx512, SimdPath::kAvx2, SimdPath::kSve, SimdPath::kNeon}) {
    if (SimdPathAvailable(p)) return p;
  }
  return SimdPath::kPortable;
}

Result<AdamStepScalars> MakeAdamStepScalars(const AdamConfig& c, int64_t step) {
  UCP_RETURN_IF_ERROR(ValidateAdamConfig(c));
  if (step < 1) {
    return InvalidArgumentError("adam step is " + std::to_string(step) +
                                ", must be >= 1 (the 1-based number of the step being taken)");
  }
  const double t = static_cast<double>(step);
  const double bias1 = c.bias_correction ? 1.0 - std::pow(double{c.beta1}, t) : 1.0;
  const double bias2 = c.bias_correction ? 1.0 - std::pow(double{c.beta2}, t) : 1.0;
  AdamStepScalars s;
  s.beta1 = c.beta1;
  s.one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  s.beta2 = c.beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  s.eps = c.eps;
  s.l2_weight_decay = c.decoupled ? 0.0f : c.weight_decay;
  s.decay = c.decoupled ? static_cast<float>(1.0 - double{c.lr} * c.weight_decay) : 1.0f;
  s.neg_step_size = static_cast<float>(-double{c.lr} / bias1);
  s.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(bias2));
  s.amsgrad = c.amsgrad;
  return s;
}

namespace internal {

Result<AdamKernelArgs> PrepareAdamArgs(const AdamConfig& c, const AdamSpans& sp,
                                       const AdamSnapshot* snap) {
  const size_t n = sp.param.size();
  if (sp.grad.dtype != LowpDType::kFp32 && sp.grad.dtype != LowpDType::kBf16 &&
      sp.grad.dtype != LowpDType::kFp16) {
    return InvalidArgumentError("adam spans: grad dtype is not fp32, bf16 or fp16");
  }
  const bool has_out = !sp.out.data.empty();
  if (has_out && sp.out.dtype == LowpDType::kFp32) {
    return InvalidArgumentError("adam spans: out dtype is fp32, must be bf16 or fp16");
  }
  if (c.amsgrad != !sp.max_exp_avg_sq.empty() && n != 0) {
    return InvalidArgumentError(c.amsgrad ? "adam spans: amsgrad is on but max_exp_avg_sq is empty"
                                          : "adam spans: max_exp_avg_sq given but amsgrad is off");
  }
  std::vector<Region> regions = {
      {"param", sp.param.data(), sp.param.size(), sp.param.size_bytes()},
      {"grad", sp.grad.data, sp.grad.size, sp.grad.size * ElementBytes(sp.grad.dtype)},
      {"exp_avg", sp.exp_avg.data(), sp.exp_avg.size(), sp.exp_avg.size_bytes()},
      {"exp_avg_sq", sp.exp_avg_sq.data(), sp.exp_avg_sq.size(), sp.exp_avg_sq.size_bytes()}};
  if (c.amsgrad) {
    regions.push_back({"max_exp_avg_sq", sp.max_exp_avg_sq.data(), sp.max_exp_avg_sq.size(),
                       sp.max_exp_avg_sq.size_bytes()});
  }
  if (has_out)
    regions.push_back({"out", sp.out.data.data(), sp.out.data.size(), sp.out.data.size_bytes()});
  if (snap != nullptr) {
    if (c.amsgrad != !snap->max_exp_avg_sq.empty() && n != 0) {
      return InvalidArgumentError(c.amsgrad
                                      ? "adam snapshot: amsgrad is on but max_exp_avg_sq is empty"
                                      : "adam snapshot: max_exp_avg_sq given but amsgrad is off");
    }
    regions.push_back(
        {"snapshot.param", snap->param.data(), snap->param.size(), snap->param.size_bytes()});
    regions.push_back({"snapshot.exp_avg", snap->exp_avg.data(), snap->exp_avg.size(),
                       snap->exp_avg.size_bytes()});
    regions.push_back({"snapshot.exp_avg_sq", snap->exp_avg_sq.data(), snap->exp_avg_sq.size(),
                       snap->exp_avg_sq.size_bytes()});
    if (c.amsgrad) {
      regions.push_back({"snapshot.max_exp_avg_sq", snap->max_exp_avg_sq.data(),
                         snap->max_exp_avg_sq.size(), snap->max_exp_avg_sq.size_bytes()});
    }
  }
  UCP_RETURN_IF_ERROR(CheckRegions(regions, n));
  AdamKernelArgs a;
  a.p = sp.param.data();
  a.g = sp.grad.data;
  a.m = sp.exp_avg.data();
  a.v = sp.exp_avg_sq.data();
  a.vmax = c.amsgrad ? sp.max_exp_avg_sq.data() : nullptr;
  a.out = has_out ? sp.out.data.data() : nullptr;
  a.n = n;
  a.grad_dtype = sp.grad.dtype;
  a.out_dtype = has_out ? sp.out.dtype : LowpDType::kFp32;
  a.amsgrad = c.amsgrad;
  a.l2 = !c.decoupled && c.weight_decay != 0.0f;
  if (snap != nullptr) {
    a.snapshot = true;
    a.snap_p = snap->param.data();
    a.snap_m = snap->exp_avg.data();
    a.snap_v = snap->exp_avg_sq.data();
    a.snap_vmax = c.amsgrad ? snap->max_exp_avg_sq.data() : nullptr;
  }
  return a;
}

AdamKernelArgs SubArgs(const AdamKernelArgs& a, size_t offset, size_t count) {
  UCP_CHECK(offset + count <= a.n);
  auto at = [&](float* f) { return f == nullptr ? f : f + offset; };
  AdamKernelArgs r = a;
  r.p = at(a.p);
  r.g = static_cast<const std::byte*>(a.g) + offset * ElementBytes(a.grad_dtype);
  r.m = at(a.m);
  r.v = at(a.v);
  r.vmax = at(a.vmax);
  r.out = a.out == nullptr ? nullptr : a.out + offset;
  r.snap_p = at(a.snap_p);
  r.snap_m = at(a.snap_m);
  r.snap_v = at(a.snap_v);
  r.snap_vmax = at(a.snap_vmax);
  r.n = count;
  return r;
}

Status CheckSimdPath(SimdPath path) {
  if (SimdPathAvailable(path)) return Status::Ok();
  return FailedPreconditionError(
      "simd path " + std::string(SimdPathName(path)) +
      " is not available (not compiled into this build, or this cpu lacks its features: avx2 "
      "needs avx2+fma+f16c, avx512 needs avx512f+avx512bw+avx512vl, sve needs an sve cpu)");
}

void RunAdamKernel(SimdPath path, const AdamConfig& config, int64_t step, const AdamStepScalars& s,
                   const AdamKernelArgs& a) {
  if (a.n == 0) return;
  switch (path) {
    case SimdPath::kScalarRef:
      AdamKernelRef(config, step, a);
      return;
    case SimdPath::kPortable:
      AdamKernelPortable(s, a);
      return;
    case SimdPath::kAvx2:
#ifdef UCP_OFFLOAD_HAVE_AVX2
      AdamKernelAvx2(s, a);
      return;
#else
      break;
#endif
    case SimdPath::kAvx512:
#ifdef UCP_OFFLOAD_HAVE_AVX512
      AdamKernelAvx512(s, a);
      return;
#else
      break;
#endif
    case SimdPath::kNeon:
#ifdef UCP_OFFLOAD_HAVE_NEON
      AdamKernelNeon(s, a);
      return;
#else
      break;
#endif
    case SimdPath::kSve:
#ifdef UCP_OFFLOAD_HAVE_SVE
      AdamKernelSve(s, a);
      return;
#else
      break;
#endif
  }
  UCP_CHECK(false) << "RunAdamKernel called with an unchecked path " << SimdPathName(path);
}

Result<AdamFusedArgs> PrepareFusedArgs(const AdamConfig& c, const AdamSpans& sp,
                                       const AdamFusedOptions& o) {
  if (o.source != nullptr && o.save != nullptr) {
    return InvalidArgumentError("adam fused step: source and save are both given (a step either "
                                "saves its pre-step state or reads it from a snapshot)");
  }
  AdamFusedArgs f;
  UCP_ASSIGN_OR_RETURN(f.args, PrepareAdamArgs(c, sp, o.save));
  f.grad_scale = o.grad_scale;
  if (o.source == nullptr || sp.param.empty()) return f;
  const AdamSnapshot& src = *o.source;
  const size_t n = sp.param.size();
  std::vector<Region> in = {
      {"source.param", src.param.data(), src.param.size(), src.param.size_bytes()},
      {"source.exp_avg", src.exp_avg.data(), src.exp_avg.size(), src.exp_avg.size_bytes()},
      {"source.exp_avg_sq", src.exp_avg_sq.data(), src.exp_avg_sq.size(),
       src.exp_avg_sq.size_bytes()}};
  if (c.amsgrad) {
    in.push_back({"source.max_exp_avg_sq", src.max_exp_avg_sq.data(), src.max_exp_avg_sq.size(),
                  src.max_exp_avg_sq.size_bytes()});
  } else if (!src.max_exp_avg_sq.empty()) {
    return InvalidArgumentError("adam fused step: source.max_exp_avg_sq given but amsgrad is off");
  }
  UCP_RETURN_IF_ERROR(CheckRegions(in, n));
  // A source may not overlap what the step writes (it is read after the outputs are written at
  // the same index only in the same lane, but a shifted overlap would read updated values).
  std::vector<Region> outs = {
      {"param", sp.param.data(), n, sp.param.size_bytes()},
      {"exp_avg", sp.exp_avg.data(), n, sp.exp_avg.size_bytes()},
      {"exp_avg_sq", sp.exp_avg_sq.data(), n, sp.exp_avg_sq.size_bytes()}};
  if (c.amsgrad) {
    outs.push_back({"max_exp_avg_sq", sp.max_exp_avg_sq.data(), n, sp.max_exp_avg_sq.size_bytes()});
  }
  if (!sp.out.data.empty()) {
    outs.push_back({"out", sp.out.data.data(), n, sp.out.data.size_bytes()});
  }
  for (const Region& a : in) {
    for (const Region& b : outs) {
      UCP_RETURN_IF_ERROR(CheckRegions({a, b}, n), "in the fused step's source");
    }
  }
  f.src_p = src.param.data();
  f.src_m = src.exp_avg.data();
  f.src_v = src.exp_avg_sq.data();
  f.src_vmax = c.amsgrad ? src.max_exp_avg_sq.data() : nullptr;
  return f;
}

AdamFusedArgs SubFusedArgs(const AdamFusedArgs& f, size_t offset, size_t count) {
  AdamFusedArgs r = f;
  r.args = SubArgs(f.args, offset, count);
  auto at = [&](const float* p) { return p == nullptr ? p : p + offset; };
  r.src_p = at(f.src_p);
  r.src_m = at(f.src_m);
  r.src_v = at(f.src_v);
  r.src_vmax = at(f.src_vmax);
  return r;
}

void RunFusedKernel(SimdPath path, const AdamStepScalars& s, const AdamFusedArgs& f) {
  if (f.args.n == 0) return;
#ifdef UCP_OFFLOAD_HAVE_AVX512
  if (path == SimdPath::kAvx512) {
    AdamFusedKernelAvx512(s, f);
    return;
  }
#endif
#ifdef UCP_OFFLOAD_HAVE_AVX2
  if (path == SimdPath::kAvx2) {
    AdamFusedKernelAvx2(s, f);
    return;
  }
#endif
  (void)path;
  AdamFusedKernelPortable(s, f);
}

void RunProbeKernel(SimdPath path, float* p, const float* g, float* m, float* v, size_t n,
                    float s) {
  switch (path) {
#ifdef UCP_OFFLOAD_HAVE_AVX2
    case SimdPath::kAvx2:
      ProbeKernelAvx2(p, g, m, v, n, s);
      return;
#endif
#ifdef UCP_OFFLOAD_HAVE_AVX512
    case SimdPath::kAvx512:
      ProbeKernelAvx512(p, g, m, v, n, s);
      return;
#endif
#ifdef UCP_OFFLOAD_HAVE_NEON
    case SimdPath::kNeon:
      ProbeKernelNeon(p, g, m, v, n, s);
      return;
#endif
#ifdef UCP_OFFLOAD_HAVE_SVE
    case SimdPath::kSve:
      ProbeKernelSve(p, g, m, v, n, s);
      return;
#endif
    default:
      ProbeKernelPortable(p, g, m, v, n, s);
      return;
  }
}

}  // namespace internal

Status AdamStep(const AdamConfig& config, int64_t step, const AdamSpans& spans, SimdPath path) {
  UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(config, step));
  UCP_ASSIGN_OR_RETURN(const internal::AdamKernelArgs a,
                       internal::PrepareAdamArgs(config, spans, nullptr));
  UCP_RETURN_IF_ERROR(internal::CheckSimdPath(path));
  internal::RunAdamKernel(path, config, step, s, a);
  return Status::Ok();
}

Status AdamStepSpeculative(const AdamConfig& config, int64_t step, const AdamSpans& spans,
                           const AdamSnapshot& snapshot, SimdPath path) {
  UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(config, step));
  UCP_ASSIGN_OR_RETURN(const internal::AdamKernelArgs a,
                       internal::PrepareAdamArgs(config, spans, &snapshot));
  UCP_RETURN_IF_ERROR(internal::CheckSimdPath(path));
  internal::RunAdamKernel(path, config, step, s, a);
  return Status::Ok();
}

Status AdamStepFused(const AdamConfig& config, int64_t step, const AdamSpans& spans,
                     const AdamFusedOptions& options, SimdPath path) {
  UCP_ASSIGN_OR_RETURN(const AdamStepScalars s, MakeAdamStepScalars(config, step));
  UCP_ASSIGN_OR_RETURN(const internal::AdamFusedArgs f,
                       internal::PrepareFusedArgs(config, spans, options));
  UCP_RETURN_IF_ERROR(internal::CheckSimdPath(path));
  internal::RunFusedKernel(path, s, f);
  return Status::Ok();
}

namespace internal {

Status CheckRollbackSizes(const AdamSpans& spans, const AdamSnapshot& snapshot) {
  const std::array<std::pair<std::span<float>, std::span<float>>, 4> pairs = {{
      {spans.param, snapshot.param},
      {spans.exp_avg, snapshot.exp_avg},
      {spans.exp_avg_sq, snapshot.exp_avg_sq},
      {spans.max_exp_avg_sq, snapshot.max_exp_avg_sq},
  }};
  static constexpr const char* kNames[] = {"param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  for (size_t i = 0; i < pairs.size(); ++i) {
    const size_t want = (i == 3 && pairs[i].first.empty()) ? 0 : spans.param.size();
    if (pairs[i].first.size() != want) {
      return InvalidArgumentError("adam rollback: " + std::string(kNames[i]) + " has " +
                                  std::to_string(pairs[i].first.size()) + " elements, param has " +
                                  std::to_string(want));
    }
    if (pairs[i].second.size() != pairs[i].first.size()) {
      return InvalidArgumentError("adam rollback: " + std::string(kNames[i]) + " has " +
                                  std::to_string(pairs[i].first.size()) +
                                  " elements, its snapshot " +
                                  std::to_string(pairs[i].second.size()));
    }
  }
  return Status::Ok();
}

}  // namespace internal

Status AdamRollback(const AdamSpans& spans, const AdamSnapshot& snapshot) {
  UCP_RETURN_IF_ERROR(internal::CheckRollbackSizes(spans, snapshot));
  const std::array<std::pair<std::span<float>, std::span<float>>, 4> pairs = {{
      {spans.param, snapshot.param},
      {spans.exp_avg, snapshot.exp_avg},
      {spans.exp_avg_sq, snapshot.exp_avg_sq},
      {spans.max_exp_avg_sq, snapshot.max_exp_avg_sq},
  }};
  for (const auto& [state, saved] : pairs) {
    if (!state.empty()) std::memcpy(state.data(), saved.data(), state.size_bytes());
  }
  return Status::Ok();
}

}  // namespace ucp::offload
