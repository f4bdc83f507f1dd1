// Internal to offload/optim: the raw-pointer arguments every Adam kernel takes, and the kernels
// of each path. adam.cc validates spans and builds these; nothing else should call them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "offload/optim/adam.h"
#include "ucp/base/result.h"

namespace ucp::offload::internal {

/// Pointers into validated, non-overlapping spans of n elements. out_dtype kFp32 means no copy.
/// The snap_* pointers are set iff `snapshot` (speculative step).
struct AdamKernelArgs {
  float* p = nullptr;
  const void* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  float* vmax = nullptr;  // amsgrad only
  uint16_t* out = nullptr;
  float* snap_p = nullptr;
  float* snap_m = nullptr;
  float* snap_v = nullptr;
  float* snap_vmax = nullptr;
  size_t n = 0;
  LowpDType grad_dtype = LowpDType::kFp32;
  LowpDType out_dtype = LowpDType::kFp32;
  bool amsgrad = false;
  bool l2 = false;
  bool snapshot = false;
};

/// The fp64 oracle: hyper-parameters and bias corrections in double, state rounded to fp32 once
/// per step, the low-precision copy rounded (RNE) from the double result.
void AdamKernelRef(const AdamConfig& config, int64_t step, const AdamKernelArgs& args);

void AdamKernelPortable(const AdamStepScalars& s, const AdamKernelArgs& args);
void AdamKernelAvx2(const AdamStepScalars& s, const AdamKernelArgs& args);
void AdamKernelAvx512(const AdamStepScalars& s, const AdamKernelArgs& args);
void AdamKernelNeon(const AdamStepScalars& s, const AdamKernelArgs& args);
void AdamKernelSve(const AdamStepScalars& s, const AdamKernelArgs& args);

/// The memory-bandwidth probe with Adam's streams: reads p, g, m, v and writes p, m, v in place
/// (p += s*g, m += s*v, v += s*m with s a run-time 0, so nothing changes but every byte moves).
void ProbeKernelPortable(float* p, const float* g, float* m, float* v, size_t n, float s);
void ProbeKernelAvx2(float* p, const float* g, float* m, float* v, size_t n, float s);
void ProbeKernelAvx512(float* p, const float* g, float* m, float* v, size_t n, float s);
void ProbeKernelNeon(float* p, const float* g, float* m, float* v, size_t n, float s);
void ProbeKernelSve(float* p, const float* g, float* m, float* v, size_t n, float s);

/// Validates `spans` (and `snapshot` when not null) for `config` and returns the kernel arguments.
/// Errors: kInvalidArgument (AdamStep's and AdamStepSpeculative's span rules).
Result<AdamKernelArgs> PrepareAdamArgs(const AdamConfig& config, const AdamSpans& spans,
                                       const AdamSnapshot* snapshot);
/// AdamRollback's checks: state spans as long as param, each snapshot span as long as its state.
/// Errors: kInvalidArgument naming the span.
Status CheckRollbackSizes(const AdamSpans& spans, const AdamSnapshot& snapshot);
/// Elements [offset, offset + count) of prepared arguments.
AdamKernelArgs SubArgs(const AdamKernelArgs& a, size_t offset, size_t count);
/// Errors: kFailedPrecondition (not compiled in, or the CPU lacks the features).
Status CheckSimdPath(SimdPath path);
/// Runs `path`'s kernel over `a` (the reference takes config and step, the others the scalars).
void RunAdamKernel(SimdPath path, const AdamConfig& config, int64_t step, const AdamStepScalars& s,
                   const AdamKernelArgs& a);
/// Runs `path`'s bandwidth probe (the reference uses the portable one).
void RunProbeKernel(SimdPath path, float* p, const float* g, float* m, float* v, size_t n, float s);

}  // namespace ucp::offload::internal

namespace ucp::offload::internal {

/// AdamStepFused's arguments: AdamStep's (snap_* set iff the pre-step state is saved), where the
/// pre-step state is read from (src_*: null for the live spans) and the gradient's multiplier.
/// Saving and reading from a source exclude each other.
struct AdamFusedArgs {
  AdamKernelArgs args;
  const float* src_p = nullptr;
  const float* src_m = nullptr;
  const float* src_v = nullptr;
  const float* src_vmax = nullptr;
  float grad_scale = 1.0f;
};

/// Where a step reads the pre-step state: f's source (a speculative step's snapshot) when it
/// has one, else the live spans (f null: a plain AdamStep).
struct PreStepState {
  const float* p;
  const float* m;
  const float* v;
  const float* vmax;
};
inline PreStepState PreStepFrom(const AdamKernelArgs& a, const AdamFusedArgs* f) {
  if (f != nullptr && f->src_p != nullptr) return {f->src_p, f->src_m, f->src_v, f->src_vmax};
  return {a.p, a.m, a.v, a.vmax};
}

void AdamFusedKernelPortable(const AdamStepScalars& s, const AdamFusedArgs& f);
void AdamFusedKernelAvx2(const AdamStepScalars& s, const AdamFusedArgs& f);
void AdamFusedKernelAvx512(const AdamStepScalars& s, const AdamFusedArgs& f);

/// Validates AdamStepFused's spans and options. Errors: as PrepareAdamArgs; kInvalidArgument
/// (source and save both given; a source span of the wrong size or overlapping an output).
Result<AdamFusedArgs> PrepareFusedArgs(const AdamConfig& config, const AdamSpans& spans,
                                       const AdamFusedOptions& options);
/// Elements [offset, offset + count).
AdamFusedArgs SubFusedArgs(const AdamFusedArgs& f, size_t offset, size_t count);
/// Runs the fused kernel of `path` (kAvx2 and kAvx512 their own vector loops, every other path
/// the portable one: all give the same bits).
void RunFusedKernel(SimdPath path, const AdamStepScalars& s, const AdamFusedArgs& f);

}  // namespace ucp::offload::internal
