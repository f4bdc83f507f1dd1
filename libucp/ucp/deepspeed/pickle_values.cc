// Plain values out of DeepSpeed pickles (see pickle_values.h).
#include "ucp/deepspeed/pickle_values.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "ucp/base/status_macros.h"

#ifndef UCP_DATA_DIR
#define UCP_DATA_DIR "."
#endif

namespace ucp::deepspeed {

using torch::PyKind;
using torch::PyValue;

Result<int64_t> AsInt(const PyValue* v, std::string_view what) {
  if (v == nullptr) return NotFoundError(std::string(what) + " is missing");
  if (v->kind() == PyKind::kInt) return v->int_value();
  if (v->kind() == PyKind::kBool) return int64_t{v->bool_value()};
  return DataLossError(std::string(what) + " is a " + std::string(PyKindName(v->kind())) +
                       ", not an int");
}

Result<double> AsDouble(const PyValue* v, std::string_view what) {
  if (v != nullptr && v->kind() == PyKind::kFloat) return v->float_value();
  UCP_ASSIGN_OR_RETURN(int64_t i, AsInt(v, what));
  return static_cast<double>(i);
}

Result<Shape> AsShape(const PyValue* v, std::string_view what) {
  if (v == nullptr || (v->kind() != PyKind::kTuple && v->kind() != PyKind::kList)) {
    return DataLossError(std::string(what) + " is not a torch.Size");
  }
  Shape s;
  for (const PyValue* d : v->items()) {
    UCP_ASSIGN_OR_RETURN(int64_t x, AsInt(d, what));
    if (x < 0) return DataLossError(std::string(what) + " has a negative dim " + std::to_string(x));
    s.push_back(x);
  }
  return s;
}

const PyValue* ObjectState(const PyValue* v) {
  if (v == nullptr || v->kind() != PyKind::kObject || v->state() == nullptr ||
      v->state()->kind() != PyKind::kDict) {
    return nullptr;
  }
  return v->state();
}

namespace {

// The escapes that keep strings JSON cannot hold (a Python 2 pickle's byte strings, str with
// lone surrogates) and bytes lossless: a value becomes {"py/str": HEX} or {"py/bytes": HEX}; a
// dict key becomes "py/str:HEX", and so does every real key that starts with "py/", so that an
// object whose one key is "py/str" or "py/bytes" is always an escape (docs/deepspeed.md).
constexpr std::string_view kKeyEscape = "py/str:";

std::string Hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string h;
  h.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    h += kDigits[c >> 4];
    h += kDigits[c & 15];
  }
  return h;
}

// Bounds the JSON of one value: pickle memo references are shared in the value tree but
// expanded in JSON, so a small hostile pickle could otherwise ask for an exponential output.
constexpr size_t kMaxJsonBytes = size_t{64} << 20;

Status AppendJsonImpl(const PyValue* v, std::string& out, int depth) {
  if (out.size() > kMaxJsonBytes) {
    return ResourceExhaustedError("a pickled value's JSON form exceeds " +
                                  std::to_string(kMaxJsonBytes >> 20) +
                                  " MiB (shared references expanded)");
  }
  if (v == nullptr || depth > 32) {
    out += "null";
    return Status::Ok();
  }
  switch (v->kind()) {
    case PyKind::kBool:
      out += v->bool_value() ? "true" : "false";
      return Status::Ok();
    case PyKind::kInt:
      out += std::to_string(v->int_value());
      return Status::Ok();
    case PyKind::kFloat: {
      if (!std::isfinite(v->float_value())) {
        out += "null";
        return Status::Ok();
      }
      char buf[32];
      auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v->float_value());
      std::string_view text(buf, end - buf);
      out += text;
      if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
      return Status::Ok();
    }
    case PyKind::kStr:
      if (!torch::IsUtf8(v->str(), /*allow_surrogates=*/false)) {
        out += "{\"py/str\":\"" + Hex(v->str()) + "\"}";
        return Status::Ok();
      }
      AppendJsonString(v->str(), out);
      return Status::Ok();
    case PyKind::kBytes:
      out += "{\"py/bytes\":\"" + Hex(v->str()) + "\"}";
      return Status::Ok();
    case PyKind::kList:
    case PyKind::kTuple: {
      out += '[';
      for (size_t i = 0; i < v->items().size(); ++i) {
        if (i) out += ',';
        UCP_RETURN_IF_ERROR(AppendJsonImpl(v->items()[i], out, depth + 1));
      }
      out += ']';
      return Status::Ok();
    }
    case PyKind::kDict: {
      out += '{';
      bool first = true;
      for (const auto& [k, val] : v->entries()) {
        if (k->kind() != PyKind::kStr) continue;
        if (!first) out += ',';
        first = false;
        AppendJsonKey(k->str(), out);
        out += ':';
        UCP_RETURN_IF_ERROR(AppendJsonImpl(val, out, depth + 1));
      }
      out += '}';
      return Status::Ok();
    }
    case PyKind::kObject:
      if (const PyValue* state = ObjectState(v); state != nullptr) {
        return AppendJsonImpl(state, out, depth + 1);
      }
      out += "null";
      return Status::Ok();
    default:
      out += "null";
      return Status::Ok();
  }
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

void AppendJsonString(std::string_view s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

void AppendJsonKey(std::string_view key, std::string& out) {
  if (key.starts_with("py/") || !torch::IsUtf8(key, /*allow_surrogates=*/false)) {
    AppendJsonString(std::string(kKeyEscape) + Hex(key), out);
    return;
  }
  AppendJsonString(key, out);
}

Status AppendJson(const PyValue* v, std::string& out) { return AppendJsonImpl(v, out, 0); }

std::optional<std::string> UnescapeHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  std::string bytes;
  bytes.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = HexValue(hex[i]), lo = HexValue(hex[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    bytes += static_cast<char>(hi * 16 + lo);
  }
  return bytes;
}

std::optional<std::string> UnescapeJsonKey(std::string_view key) {
  if (!key.starts_with(kKeyEscape)) return std::string(key);
  return UnescapeHex(key.substr(kKeyEscape.size()));
}

std::string ShapeString(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

std::filesystem::path RuleSetDir(const std::filesystem::path& option) {
  if (!option.empty()) return option;
  const char* env = std::getenv("UCP_DATA_DIR");
  return std::filesystem::path(env != nullptr && *env != '\0' ? env : UCP_DATA_DIR) / "patterns";
}

}  // namespace ucp::deepspeed
