// Status formatting and the code -> exit-code table (docs/errors.md is its prose twin).
#include "ucp/base/status.h"

#include <cstring>

namespace ucp {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kAlreadyExists: return "already_exists";
    case StatusCode::kFailedPrecondition: return "failed_precondition";
    case StatusCode::kOutOfRange: return "out_of_range";
    case StatusCode::kUnimplemented: return "unimplemented";
    case StatusCode::kDataLoss: return "data_loss";
    case StatusCode::kResourceExhausted: return "resource_exhausted";
    case StatusCode::kIoError: return "io_error";
    case StatusCode::kDeviceError: return "device_error";
    case StatusCode::kInternal: return "internal";
  }
  return "unknown";
}

int ExitCodeFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return 0;
    case StatusCode::kInvalidArgument: return 3;
    case StatusCode::kNotFound: return 4;
    case StatusCode::kFailedPrecondition: return 5;
    case StatusCode::kDataLoss: return 6;
    case StatusCode::kUnimplemented: return 7;
    case StatusCode::kIoError: return 8;
    case StatusCode::kResourceExhausted: return 9;
    case StatusCode::kDeviceError: return 10;
    case StatusCode::kAlreadyExists: return 11;
    case StatusCode::kOutOfRange: return 12;
    case StatusCode::kInternal: return 70;
  }
  return 70;
}

std::string EscapeControlCharacters(std::string text) {
  auto is_control = [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u < 0x20 || u == 0x7f;
  };
  size_t i = 0;
  while (i < text.size() && !is_control(text[i])) ++i;
  if (i == text.size()) return text;
  std::string out = text.substr(0, i);
  static constexpr char kHex[] = "0123456789abcdef";
  for (; i < text.size(); ++i) {
    const char c = text[i];
    if (!is_control(c)) {
      out.push_back(c);
    } else if (c == '\n') {
      out.append("\\n");
    } else if (c == '\r') {
      out.append("\\r");
    } else if (c == '\t') {
      out.append("\\t");
    } else {
      const auto u = static_cast<unsigned char>(c);
      out.append("\\x").push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 15]);
    }
  }
  return out;
}

Status Status::WithContext(std::string_view context) && {
  if (ok() || context.empty()) return std::move(*this);
  message_.append("; ").append(EscapeControlCharacters(std::string(context)));
  return std::move(*this);
}

Status Status::WithContext(std::string_view context) const& {
  Status copy = *this;
  return std::move(copy).WithContext(context);
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  std::string out(StatusCodeName(code_));
  out.append(": ").append(message_);
  return out;
}

std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }
std::ostream& operator<<(std::ostream& os, StatusCode c) { return os << StatusCodeName(c); }

Status ErrnoError(std::string what, int errno_value) {
  what.append(": ").append(std::strerror(errno_value));
  return IoError(std::move(what));
}

}  // namespace ucp
