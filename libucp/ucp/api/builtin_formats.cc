// The formats every ucp program knows, in detection order: one line per format (ADR 0008).
// ucp's own files decide first, so a ucp checkpoint written into a folder that also holds other
// files is read as ucp.
#include "ucp/api/format.h"
#include "ucp/api/ucp_format.h"
#include "ucp/base/check.h"
#include "ucp/deepspeed/deepspeed_format.h"
#include "ucp/hf/hf_format.h"

namespace ucp::api {

const FormatRegistry& Formats() {
  static const FormatRegistry* registry = [] {
    auto* r = new FormatRegistry();
    UCP_CHECK(r->Add(MakeUcpFormat()).ok());
    // deepspeed-universal before deepspeed: its folders hold DeepSpeed's model-state files too.
    UCP_CHECK(r->Add(deepspeed::MakeDeepSpeedUniversalFormat()).ok());
    UCP_CHECK(r->Add(deepspeed::MakeDeepSpeedFormat()).ok());
    UCP_CHECK(r->Add(hf::MakeHfFormat()).ok());
    return r;
  }();
  return *registry;
}

}  // namespace ucp::api
