// Strict JSON parsing for every metadata file ucp reads (the universal manifest, ucp_layout.json,
// rule sets and model presets, client state): nlohmann/json keeps the last of two duplicate keys
// silently, which would let a corrupt or hand-edited file mean something else than it says, so
// duplicates are refused at any depth, as is nesting deeper than a bound. This folder is the one
// that includes nlohmann/json; exceptions from it stop here.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::json {

using Json = nlohmann::json;
/// Keeps object keys in document order (for values that are re-pickled in their original order,
/// such as Megatron's args).
using OrderedJson = nlohmann::ordered_json;

/// Parses `text` as one JSON value.
/// Errors, all with `code` and starting with `what`: "<what> is not valid json: <parser
/// message>"; "<what>: duplicate key "k" at /a/0/b" (the JSON pointer of the object holding the
/// key, "/" for the top); "<what>: nesting deeper than N levels at /a/...".
Result<Json> ParseStrict(std::string_view text, const std::string& what, StatusCode code,
                         int max_depth = 64);
/// As ParseStrict, keeping keys in document order.
Result<OrderedJson> ParseStrictOrdered(std::string_view text, const std::string& what,
                                       StatusCode code, int max_depth = 64);

}  // namespace ucp::json
