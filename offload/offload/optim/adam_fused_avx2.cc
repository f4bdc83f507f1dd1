// AdamStepFused's kernel compiled with -mavx2 -mfma -mf16c (vectorised by the compiler; the loop
// is adam_fused_loop.h). Called only when the CPU has all three.
#include "offload/optim/adam_fused_loop.h"

namespace ucp::offload::internal {

void AdamFusedKernelAvx2(const AdamStepScalars& s, const AdamFusedArgs& f) { RunFused(s, f); }

}  // namespace ucp::offload::internal
