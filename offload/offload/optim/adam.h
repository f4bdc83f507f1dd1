// The CPU Adam/AdamW optimizer of the offload engine: one fused, element-wise pass over contiguous
// fp32 spans (param, grad, exp_avg, exp_avg_sq), with an optional fused bf16/fp16 copy of the
// updated weights for the GPU. Vector paths (AVX-512, AVX2+FMA, NEON, SVE) are picked at run time
// by CPU features; a double-precision scalar reference is the tests' oracle (docs/offload.md).
//
// Determinism: every fp32 path (portable, AVX2, AVX-512, NEON, SVE) evaluates the same fp32
// expression in the same order, with fused multiply-adds in the same places and correctly rounded
// sqrt and division, so all of them give bitwise identical results, for any thread count and any
// split of the spans into buckets or fragments (the update is element-wise).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::offload {

/// Hyper-parameters, as in torch.optim.Adam / AdamW.
struct AdamConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  /// true: AdamW (p *= 1 - lr * weight_decay before the update); false: L2 (g += wd * p).
  bool decoupled = true;
  /// Keep max_exp_avg_sq and divide by its square root (torch's amsgrad=True).
  bool amsgrad = false;
  /// Divide exp_avg by 1 - beta1^t and exp_avg_sq by 1 - beta2^t (torch always does).
  bool bias_correction = true;
};

/// Checks the hyper-parameters: lr >= 0, eps >= 0 and weight_decay >= 0, all finite, and
/// 0 <= beta < 1.
/// Errors: kInvalidArgument naming the field and its value.
Status ValidateAdamConfig(const AdamConfig& config);

/// The element type of a gradient or of the low-precision weight copy.
enum class LowpDType : uint8_t { kFp32, kBf16, kFp16 };

/// "fp32", "bf16", "fp16" (the names of ucp's DType X-list).
std::string_view LowpDTypeName(LowpDType dtype);

/// A read-only gradient span: fp32, or bf16/fp16 bit patterns (uint16_t).
struct GradSpan {
  LowpDType dtype = LowpDType::kFp32;
  const void* data = nullptr;
  size_t size = 0;

  static GradSpan Fp32(std::span<const float> g) { return {LowpDType::kFp32, g.data(), g.size()}; }
  static GradSpan Bf16(std::span<const uint16_t> g) {
    return {LowpDType::kBf16, g.data(), g.size()};
  }
  static GradSpan Fp16(std::span<const uint16_t> g) {
    return {LowpDType::kFp16, g.data(), g.size()};
  }
  /// Elements [offset, offset + count); the caller keeps it in range.
  GradSpan Sub(size_t offset, size_t count) const;
};

/// The optional fused copy of the updated weights: bf16 or fp16 bit patterns, round to nearest
/// even. An empty span (the default) writes nothing.
struct LowpOutSpan {
  LowpDType dtype = LowpDType::kBf16;  ///< kBf16 or kFp16
  std::span<uint16_t> data;

  static LowpOutSpan Bf16(std::span<uint16_t> d) { return {LowpDType::kBf16, d}; }
  static LowpOutSpan Fp16(std::span<uint16_t> d) { return {LowpDType::kFp16, d}; }
};

/// One contiguous run of elements to step: a parameter, a bucket, or a fragment of either.
/// All spans have the same size; max_exp_avg_sq is given iff AdamConfig::amsgrad.
/// The spans must not overlap one another (nothing is updated through a temporary).
struct AdamSpans {
  std::span<float> param;
  GradSpan grad;
  std::span<float> exp_avg;
  std::span<float> exp_avg_sq;
  std::span<float> max_exp_avg_sq;  ///< amsgrad only
  LowpOutSpan out;                  ///< optional bf16/fp16 copy of the updated param

  size_t size() const { return param.size(); }
  /// Elements [offset, offset + count) of every span; the caller keeps it in range.
  AdamSpans Sub(size_t offset, size_t count) const;
};

/// Where an AdamStepSpeculative call keeps the pre-step values, so that AdamRollback can restore
/// them bitwise. Same size as the spans it saves; max_exp_avg_sq iff amsgrad. Caller-owned.
struct AdamSnapshot {
  std::span<float> param;
  std::span<float> exp_avg;
  std::span<float> exp_avg_sq;
  std::span<float> max_exp_avg_sq;

  AdamSnapshot Sub(size_t offset, size_t count) const;
};

/// The implementations. kScalarRef is the fp64 oracle (slow; for tests and checks).
enum class SimdPath : uint8_t { kScalarRef, kPortable, kAvx2, kAvx512, kNeon, kSve };

/// "ref", "portable", "avx2", "avx512", "neon", "sve".
std::string_view SimdPathName(SimdPath path);
/// The inverse of SimdPathName.
/// Errors: kInvalidArgument listing the names.
Result<SimdPath> ParseSimdPath(std::string_view name);
/// Compiled into this binary and supported by this CPU (AVX2 needs avx2+fma+f16c; AVX-512 needs
/// avx512f+avx512bw+avx512vl).
bool SimdPathAvailable(SimdPath path);
/// The fastest available path: avx512, avx2, sve, neon, then portable.
SimdPath BestSimdPath();

/// The per-step scalars every path shares, computed once in double and rounded to fp32 so that
/// all paths use the same constants. `step` is the 1-based number of the step being taken.
struct AdamStepScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float l2_weight_decay;  ///< weight_decay when !decoupled, else 0
  float decay;            ///< 1 - lr * weight_decay when decoupled, else 1
  float neg_step_size;    ///< -lr / (1 - beta1^t)
  float inv_sqrt_bias2;   ///< 1 / sqrt(1 - beta2^t)
  bool amsgrad;
};

/// Errors: kInvalidArgument (config, or step < 1).
Result<AdamStepScalars> MakeAdamStepScalars(const AdamConfig& config, int64_t step);

/// One Adam step of `spans` on the calling thread. `step` is the 1-based number of this step (the
/// value torch's state["step"] has after its increment), the same for every bucket of a step.
/// Per element, in fp32 (g widened exactly from bf16/fp16):
///   g += l2_wd * p (L2 only);  m = fma(b1, m, (1-b1) * g);  v = fma(b2, v, ((1-b2) * g) * g);
///   vmax = max(vmax, v) (amsgrad);  d = fma(sqrt(v or vmax), 1/sqrt(bc2), eps);
///   p = fma(-lr/bc1, m / d, p * (1 - lr * wd));  out = RNE(p) in bf16/fp16.
/// Errors: kInvalidArgument (config, step < 1, span sizes differ, overlapping spans,
/// max_exp_avg_sq given or missing for amsgrad, out dtype fp32), kFailedPrecondition (path not
/// available on this CPU or not compiled in).
Status AdamStep(const AdamConfig& config, int64_t step, const AdamSpans& spans,
                SimdPath path = BestSimdPath());

/// As AdamStep, and also writes the pre-step param, exp_avg, exp_avg_sq (and max_exp_avg_sq) into
/// `snapshot` in the same pass, so that AdamRollback can undo the step bitwise.
/// Errors: as AdamStep, and kInvalidArgument (snapshot sizes differ from the spans, or overlap).
Status AdamStepSpeculative(const AdamConfig& config, int64_t step, const AdamSpans& spans,
                           const AdamSnapshot& snapshot, SimdPath path = BestSimdPath());

/// Copies `snapshot` back into the state spans of `spans` (param, exp_avg, exp_avg_sq,
/// max_exp_avg_sq), undoing one AdamStepSpeculative bitwise. grad and out are not touched: the
/// low-precision copy is stale until the bucket is stepped again.
/// Errors: kInvalidArgument (sizes differ, max_exp_avg_sq present in one but not the other).
Status AdamRollback(const AdamSpans& spans, const AdamSnapshot& snapshot);

/// How AdamStepFused reads its pre-step state and scales the gradient (the offloaded pipeline's
/// kernel: offload/engine). At most one of `source` and `save`.
struct AdamFusedOptions {
  /// Read the pre-step param, exp_avg, exp_avg_sq (and max_exp_avg_sq) from here instead of the
  /// live spans: a speculative step's snapshot, so that re-taking the step with another gradient
  /// scale (the clip correction) is one pass and needs no rollback. null: the live spans.
  const AdamSnapshot* source = nullptr;
  /// Save the pre-step state here in the same pass (a speculative step). null: nothing saved.
  const AdamSnapshot* save = nullptr;
  /// The gradient used is fl(widen(grad) * grad_scale): one fp32 multiply, as a caller that
  /// scales the gradient in place before AdamStep does (1 / loss_scale, times the clip factor).
  float grad_scale = 1.0f;
};

/// AdamStep with the gradient multiplied by options.grad_scale, the pre-step state read from
/// options.source (when given) and saved into options.save (when given). Bitwise:
///   AdamStepFused(spans, {.grad_scale = c}) == (g *= c in fp32; AdamStep(spans))
///   AdamStepFused(spans, {.source = &snap, .grad_scale = c}) after a speculative step that saved
///   `snap` == the same step taken directly from the pre-step state with scale c
/// for every path and size (a multiply by 1.0f changes no value but a NaN's payload). So a
/// speculative step corrected for clipping equals the clipped step exactly: the correction has
/// no error to bound. Traffic: a step's (read p, m, v, g; write p, m, v, out), plus the 12 B/param
/// snapshot written when saving.
/// Errors: as AdamStepSpeculative; kInvalidArgument (source and save both given, a source span
/// of the wrong size, or overlapping an output span).
Status AdamStepFused(const AdamConfig& config, int64_t step, const AdamSpans& spans,
                     const AdamFusedOptions& options, SimdPath path = BestSimdPath());

}  // namespace ucp::offload
