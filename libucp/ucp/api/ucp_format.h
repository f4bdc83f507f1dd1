// ucp's own format as a plug-in (api/format.h): "ucp" reads distributed and universal folders
// and writes either (ToLayout / Extract in api/checkpoint.h), by the target layout.
#pragma once

#include <memory>

#include "ucp/api/format.h"

namespace ucp::api {

/// The "ucp" format. Registered first (api/builtin_formats.cc): its files decide over any other.
std::unique_ptr<CheckpointFormat> MakeUcpFormat();

}  // namespace ucp::api
