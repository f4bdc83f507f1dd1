// libFuzzer target for the strict JSON parser every ucp metadata file goes through: any input
// either fails with a Status or parses to a value that prints and re-parses to itself; the depth
// limit holds for both the plain and the order-keeping parser. Crashes, leaks, sanitizer reports
// and memory beyond -rss_limit_mb are bugs.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ucp/json/strict_json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto plain = ucp::json::ParseStrict(text, "fuzz.json", ucp::StatusCode::kDataLoss);
  auto ordered = ucp::json::ParseStrictOrdered(text, "fuzz.json", ucp::StatusCode::kDataLoss);
  if (plain.ok() != ordered.ok()) __builtin_trap();  // the two parsers accept the same texts
  if (!plain.ok()) {
    if (plain.status().code() != ucp::StatusCode::kDataLoss) __builtin_trap();
    return 0;
  }
  const std::string again = plain->dump();
  auto reparsed = ucp::json::ParseStrict(again, "fuzz.json", ucp::StatusCode::kDataLoss);
  if (!reparsed.ok() || *reparsed != *plain) __builtin_trap();
  return 0;
}
