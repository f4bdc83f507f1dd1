// Status and StatusCode: how every fallible call in libucp and offload reports failure.
// The library never throws; a Status carries a code (mapped to a CLI exit code, docs/errors.md)
// and a lowercase message that names the tensor, file and field, with context appended per layer.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace ucp {

/// `text` with each ASCII control character (0x00-0x1f, 0x7f) escaped, the rest unchanged:
/// `\n`, `\r`, `\t` as those two-character escapes, others as `\xNN`. Returns `text` itself
/// (no copy) when it has none. Used for every Status message and its context, so that paths and
/// library text with newlines never split an error line.
std::string EscapeControlCharacters(std::string text);

/// The codes a Status can carry. Keep in step with docs/errors.md and ExitCodeFor().
enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,     ///< bad user input: options, rule file, layout string
  kNotFound,            ///< a file, parameter, key or state is missing
  kAlreadyExists,       ///< the output exists and would be overwritten
  kFailedPrecondition,  ///< valid input that does not fit: heads not divisible by tp
  kOutOfRange,          ///< an index or range outside its bounds
  kUnimplemented,       ///< valid but unsupported: format version, dtype, pickle opcode
  kDataLoss,            ///< corrupt or inconsistent data: bad magic, checksum, holes, overlaps
  kResourceExhausted,   ///< an allocation or a memory budget was exceeded
  kIoError,             ///< an OS-level read, write, fsync or rename failed
  kDeviceError,         ///< a CUDA or NCCL call failed
  kInternal,            ///< a bug we detected
};

/// "invalid_argument", "data_loss", ...: the stable name used in messages and JSON output.
std::string_view StatusCodeName(StatusCode code);

/// The process exit code the CLI uses for a failure of this code (0 for kOk).
int ExitCodeFor(StatusCode code);

/// A code plus a message. Cheap to pass when ok (no allocation).
class [[nodiscard]] Status {
 public:
  Status() = default;
  /// Control characters in `message` (a newline in a path, HDF5's multi-line text) are escaped
  /// (`\n`, `\xNN`): an error is one line, always.
  Status(StatusCode code, std::string message)
      : code_(code), message_(EscapeControlCharacters(std::move(message))) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// Appends "; <context>" to the message (no-op when ok). Used as each layer unwinds.
  Status WithContext(std::string_view context) &&;
  Status WithContext(std::string_view context) const&;

  /// "data_loss: checksum mismatch ..." (or "ok").
  std::string ToString() const;

  /// Marks a deliberately ignored status, e.g. a best-effort cleanup after an earlier error.
  void IgnoreError() const {}

  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

std::ostream& operator<<(std::ostream& os, const Status& s);
std::ostream& operator<<(std::ostream& os, StatusCode c);

// Short constructors; messages start lowercase and have no final period.
inline Status InvalidArgumentError(std::string m) {
  return Status(StatusCode::kInvalidArgument, std::move(m));
}
inline Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
inline Status AlreadyExistsError(std::string m) {
  return Status(StatusCode::kAlreadyExists, std::move(m));
}
inline Status FailedPreconditionError(std::string m) {
  return Status(StatusCode::kFailedPrecondition, std::move(m));
}
inline Status OutOfRangeError(std::string m) {
  return Status(StatusCode::kOutOfRange, std::move(m));
}
inline Status UnimplementedError(std::string m) {
  return Status(StatusCode::kUnimplemented, std::move(m));
}
inline Status DataLossError(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
inline Status ResourceExhaustedError(std::string m) {
  return Status(StatusCode::kResourceExhausted, std::move(m));
}
inline Status IoError(std::string m) { return Status(StatusCode::kIoError, std::move(m)); }
inline Status DeviceError(std::string m) {
  return Status(StatusCode::kDeviceError, std::move(m));
}
inline Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }

/// An IoError whose message ends with strerror(errno_value).
Status ErrnoError(std::string what, int errno_value);

}  // namespace ucp
