// AdamStepFused's portable kernel (the loop is adam_fused_loop.h).
#include "offload/optim/adam_fused_loop.h"

namespace ucp::offload::internal {

void AdamFusedKernelPortable(const AdamStepScalars& s, const AdamFusedArgs& f) { RunFused(s, f); }

}  // namespace ucp::offload::internal
