// libFuzzer target for layout strings (`--layout`, ucp_layout.json's `layout`): any text fails
// with invalid_argument or parses to a layout within the bounds (kMaxAxisSize, kMaxWorldSize)
// whose canonical string parses back to the same layout.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ucp/layout/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto layout = ucp::layout::ParseLayout(text);
  if (!layout.ok()) {
    if (layout.status().code() != ucp::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  if (!ucp::layout::Validate(*layout).ok()) __builtin_trap();
  const std::string canonical = ucp::layout::ToString(*layout);
  auto back = ucp::layout::ParseLayout(canonical);
  if (!back.ok() || ucp::layout::ToString(*back) != canonical) __builtin_trap();
  return 0;
}
