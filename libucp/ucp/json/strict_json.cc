// ParseStrict: nlohmann's SAX parser driving its own DOM builder through a handler that tracks
// the JSON pointer of the value being parsed and stops at the first duplicate key or over-deep
// nesting, so a hostile document costs memory bounded by its depth limit, not by its size. The
// exceptions stop here.
#include "ucp/json/strict_json.h"

#include <cstdint>
#include <exception>
#include <new>
#include <set>
#include <utility>
#include <vector>

namespace ucp::json {

namespace {

// Wraps nlohmann's DOM builder: every event is checked first, then forwarded.
template <typename J>
class StrictSax {
 public:
  using number_integer_t = typename J::number_integer_t;
  using number_unsigned_t = typename J::number_unsigned_t;
  using number_float_t = typename J::number_float_t;
  using string_t = typename J::string_t;
  using binary_t = typename J::binary_t;

  StrictSax(J& root, int max_depth) : dom_(root, /*allow_exceptions=*/false), max_depth_(max_depth) {}

  const std::string& error() const { return error_; }
  bool syntax_error() const { return syntax_error_; }

  bool null() { return Scalar() && dom_.null(); }
  bool boolean(bool v) { return Scalar() && dom_.boolean(v); }
  bool number_integer(number_integer_t v) { return Scalar() && dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) { return Scalar() && dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) {
    return Scalar() && dom_.number_float(v, s);
  }
  bool string(string_t& v) { return Scalar() && dom_.string(v); }
  bool binary(binary_t& v) { return Scalar() && dom_.binary(v); }

  bool start_object(std::size_t n) { return Open(true) && dom_.start_object(n); }
  bool start_array(std::size_t n) { return Open(false) && dom_.start_array(n); }
  bool end_object() { return Close() && dom_.end_object(); }
  bool end_array() { return Close() && dom_.end_array(); }

  bool key(string_t& k) {
    Frame& f = stack_.back();
    if (!f.keys.insert(k).second) {
      error_ = "duplicate key \"" + k + "\" at " + (f.path.empty() ? std::string("/") : f.path);
      return false;
    }
    f.last_key = k;
    return dom_.key(k);
  }

  template <typename Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/, const Exception& ex) {
    error_ = ex.what();
    syntax_error_ = true;
    return false;
  }

 private:
  struct Frame {
    bool is_object;
    std::set<string_t> keys;
    string_t last_key;
    int64_t index = 0;
    std::string path;
  };

  std::string ChildPath() const {
    if (stack_.empty()) return "";
    const Frame& f = stack_.back();
    return f.path + "/" + (f.is_object ? f.last_key : std::to_string(f.index));
  }
  void AfterValue() {
    if (!stack_.empty() && !stack_.back().is_object) ++stack_.back().index;
  }
  bool Scalar() {
    AfterValue();
    return true;
  }
  bool Open(bool is_object) {
    std::string p = ChildPath();
    if (static_cast<int64_t>(stack_.size()) >= max_depth_) {
      error_ = "nesting deeper than " + std::to_string(max_depth_) + " levels at " + p;
      return false;
    }
    stack_.push_back({is_object, {}, {}, 0, std::move(p)});
    return true;
  }
  bool Close() {
    stack_.pop_back();
    AfterValue();
    return true;
  }

  nlohmann::detail::json_sax_dom_parser<J> dom_;
  int64_t max_depth_;
  std::vector<Frame> stack_;
  std::string error_;
  bool syntax_error_ = false;
};

template <typename J>
Result<J> Parse(std::string_view text, const std::string& what, StatusCode code, int max_depth) {
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore what follows it
  // ("{}\0garbage" parses). No JSON text holds a raw NUL (inside strings it is escaped), so any
  // NUL is refused before parsing.
  if (size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return Status(code, what + " is not valid json: a NUL byte at offset " + std::to_string(nul));
  }
  J j;
  StrictSax<J> sax(j, max_depth);
  try {
    const bool ok = J::sax_parse(text.begin(), text.end(), &sax, nlohmann::json::input_format_t::json,
                                 /*strict=*/true);
    if (!ok || !sax.error().empty()) {
      if (sax.syntax_error() || sax.error().empty()) {
        return Status(code, what + " is not valid json: " +
                                (sax.error().empty() ? std::string("parse stopped") : sax.error()));
      }
      return Status(code, what + ": " + sax.error());
    }
  } catch (const std::bad_alloc&) {
    return Status(StatusCode::kResourceExhausted,
                  what + ": out of memory parsing " + std::to_string(text.size()) + " bytes of json");
  } catch (const std::exception& e) {
    return Status(code, what + " is not valid json: " + e.what());
  }
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
