// Plain values out of DeepSpeed pickles (see pickle_values.h).
#include "ucp/deepspeed/pickle_values.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

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

void AppendJson(const PyValue* v, std::string& out, int depth) {
  auto str = [&out](std::string_view s) { AppendJsonString(s, out); };
  if (v == nullptr || depth > 32) {
    out += "null";
    return;
  }
  switch (v->kind()) {
    case PyKind::kBool:
      out += v->bool_value() ? "true" : "false";
      return;
    case PyKind::kInt:
      out += std::to_string(v->int_value());
      return;
    case PyKind::kFloat: {
      if (!std::isfinite(v->float_value())) {
        out += "null";
        return;
      }
      char buf[32];
      auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v->float_value());
      std::string_view text(buf, end - buf);
      out += text;
      if (text.find_first_of(".e") == std::string_view::npos) out += ".0";
      return;
    }
    case PyKind::kStr:
      str(v->str());
      return;
    case PyKind::kList:
    case PyKind::kTuple: {
      out += '[';
      for (size_t i = 0; i < v->items().size(); ++i) {
        if (i) out += ',';
        AppendJson(v->items()[i], out, depth + 1);
      }
      out += ']';
      return;
    }
    case PyKind::kDict: {
      out += '{';
      bool first = true;
      for (const auto& [k, val] : v->entries()) {
        if (k->kind() != PyKind::kStr) continue;
        if (!first) out += ',';
        first = false;
        str(k->str());
        out += ':';
        AppendJson(val, out, depth + 1);
      }
      out += '}';
      return;
    }
    case PyKind::kObject:
      if (const PyValue* state = ObjectState(v); state != nullptr) {
        AppendJson(state, out, depth + 1);
        return;
      }
      out += "null";
      return;
    default:
      out += "null";
      return;
  }
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
