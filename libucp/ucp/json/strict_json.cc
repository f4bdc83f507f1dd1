// ParseStrict: nlohmann's parser with a callback that tracks the JSON pointer of the value being
// parsed, records the first duplicate key or over-deep nesting, and stops the exceptions.
#include "ucp/json/strict_json.h"

#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace ucp::json {

namespace {

template <typename J>
Result<J> Parse(std::string_view text, const std::string& what, StatusCode code, int max_depth) {
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string last_key;
    int64_t index = 0;
    std::string path;
  };
  std::vector<Frame> stack;
  std::string error;
  auto child_path = [&]() -> std::string {
    if (stack.empty()) return "";
    const Frame& f = stack.back();
    return f.path + "/" + (f.is_object ? f.last_key : std::to_string(f.index));
  };
  auto after_value = [&] {
    if (!stack.empty() && !stack.back().is_object) ++stack.back().index;
  };
  typename J::parser_callback_t cb = [&](int depth, typename J::parse_event_t event,
                                         J& parsed) -> bool {
    if (!error.empty()) return true;
    if (depth > max_depth) {
      error = "nesting deeper than " + std::to_string(max_depth) + " levels at " + child_path();
      return true;
    }
    switch (event) {
      case J::parse_event_t::object_start:
      case J::parse_event_t::array_start: {
        std::string p = child_path();
        stack.push_back({event == J::parse_event_t::object_start, {}, {}, 0, std::move(p)});
        break;
      }
      case J::parse_event_t::object_end:
      case J::parse_event_t::array_end:
        if (!stack.empty()) stack.pop_back();
        after_value();
        break;
      case J::parse_event_t::key: {
        std::string k = parsed.template get<std::string>();
        if (!stack.empty()) {
          if (!stack.back().keys.insert(k).second) {
            error = "duplicate key \"" + k + "\" at " +
                    (stack.back().path.empty() ? std::string("/") : stack.back().path);
          }
          stack.back().last_key = std::move(k);
        }
        break;
      }
      case J::parse_event_t::value:
        after_value();
        break;
    }
    return true;
  };
  J j;
  try {
    j = J::parse(text.begin(), text.end(), cb);
  } catch (const typename J::exception& e) {
    return Status(code, what + " is not valid json: " + e.what());
  }
  if (!error.empty()) return Status(code, what + ": " + error);
  return j;
}

}  // namespace

Result<Json> ParseStrict(std::string_view text, const std::string& what, StatusCode code,
                         int max_depth) {
  return Parse<Json>(text, what, code, max_depth);
}

Result<OrderedJson> ParseStrictOrdered(std::string_view text, const std::string& what,
                                       StatusCode code, int max_depth) {
  return Parse<OrderedJson>(text, what, code, max_depth);
}

}  // namespace ucp::json
