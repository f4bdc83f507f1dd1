// The portable path: the canonical fp32 element loop, no intrinsics. On x86-64 without -mfma the
// fused multiply-adds are library calls, so this path is correct everywhere but slow there; it
// exists for CPUs without AVX2 and as the plain-C++ statement of what the vector paths compute.
#include "offload/optim/adam_element.h"
#include "offload/optim/adam_kernel.h"

namespace ucp::offload::internal {

void AdamKernelPortable(const AdamStepScalars& s, const AdamKernelArgs& a) {
  DispatchAdam(a, [&](auto gc, auto oc, auto ac, auto lc, auto sc) {
    AdamScalarLoop<decltype(gc)::value, decltype(oc)::value, decltype(ac)::value,
                   decltype(lc)::value, decltype(sc)::value>(s, a, 0, a.n);
  });
}

void ProbeKernelPortable(float* p, const float* g, float* m, float* v, size_t n, float s) {
  ProbeScalarLoop(p, g, m, v, 0, n, s);
}

}  // namespace ucp::offload::internal
