// The fp64 scalar reference (the tests' oracle): the textbook Adam/AdamW step evaluated in double
// from the fp32 state, then rounded to fp32 once. Written for clarity, not speed.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "offload/optim/adam_kernel.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::internal {

void AdamKernelRef(const AdamConfig& c, int64_t step, const AdamKernelArgs& a) {
  const double beta1 = c.beta1;
  const double beta2 = c.beta2;
  const double lr = c.lr;
  const double eps = c.eps;
  const double wd = c.weight_decay;
  const double t = static_cast<double>(step);
  const double bias1 = c.bias_correction ? 1.0 - std::pow(beta1, t) : 1.0;
  const double bias2 = c.bias_correction ? 1.0 - std::pow(beta2, t) : 1.0;
  for (size_t i = 0; i < a.n; ++i) {
    if (a.snapshot) {
      a.snap_p[i] = a.p[i];
      a.snap_m[i] = a.m[i];
      a.snap_v[i] = a.v[i];
      if (a.amsgrad) a.snap_vmax[i] = a.vmax[i];
    }
    double p = a.p[i];
    double m = a.m[i];
    double v = a.v[i];
    double g = 0;
    switch (a.grad_dtype) {
      case LowpDType::kFp32:
        g = static_cast<const float*>(a.g)[i];
        break;
      case LowpDType::kBf16:
        g = FloatFromBf16(static_cast<const uint16_t*>(a.g)[i]);
        break;
      case LowpDType::kFp16:
        g = Fp16Format::ToDouble(static_cast<const uint16_t*>(a.g)[i]);
        break;
    }
    if (c.decoupled) {
      p *= 1.0 - lr * wd;
    } else {
      g += wd * p;
    }
    m = beta1 * m + (1.0 - beta1) * g;
    v = beta2 * v + (1.0 - beta2) * g * g;
    double v_used = v;
    if (a.amsgrad) {
      v_used = std::max(static_cast<double>(a.vmax[i]), v);
      a.vmax[i] = static_cast<float>(v_used);
    }
    const double denom = std::sqrt(v_used) / std::sqrt(bias2) + eps;
    p -= (lr / bias1) * m / denom;
    a.p[i] = static_cast<float>(p);
    a.m[i] = static_cast<float>(m);
    a.v[i] = static_cast<float>(v);
    if (a.out_dtype == LowpDType::kBf16) {
      a.out[i] = static_cast<uint16_t>(Bf16Format::FromDouble(p));
    } else if (a.out_dtype == LowpDType::kFp16) {
      a.out[i] = static_cast<uint16_t>(Fp16Format::FromDouble(p));
    }
  }
}

}  // namespace ucp::offload::internal
