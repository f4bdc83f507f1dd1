// Parameter-name escaping and containment checks for relative paths.
#include "ucp/io/safe_name.h"

#include <cstdio>
#include <system_error>

#include "ucp/base/status_macros.h"
#include "ucp/io/checksum.h"

namespace ucp::io {
namespace fs = std::filesystem;
namespace {

constexpr size_t kMaxEscapedBytes = 200;
constexpr size_t kCutBytes = 183;

bool IsSafeByte(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '_' || c == '-';
}

}  // namespace

Result<std::string> EscapeName(std::string_view name) {
  if (name.empty()) return InvalidArgumentError("parameter name is empty");
  if (name == "." || name == "..") {
    return InvalidArgumentError("parameter name '" + std::string(name) +
                                "' is not allowed: it would name a folder");
  }
  std::string out;
  out.reserve(name.size());
  for (char ch : name) {
    auto c = static_cast<unsigned char>(ch);
    if (IsSafeByte(c)) {
      out.push_back(ch);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "%%%02X", c);
      out += hex;
    }
  }
  if (out.size() > kMaxEscapedBytes) {
    // Cut at a byte that does not split a %XX escape, then make it unique with a hash.
    size_t cut = kCutBytes;
    if (out[cut - 1] == '%')
      cut -= 1;
    else if (out[cut - 2] == '%')
      cut -= 2;
    std::string hash = FormatXxh3(Xxh3_64(std::as_bytes(std::span(name.data(), name.size()))));
    out = out.substr(0, cut) + "~" + hash.substr(hash.size() - 16);
  }
  return out;
}

Result<std::string> ParamFileName(std::string_view name) {
  UCP_ASSIGN_OR_RETURN(std::string escaped, EscapeName(name));
  return "params/" + escaped + ".h5";
}

Status ValidateRelativePath(std::string_view rel, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return DataLossError(what + " '" + std::string(rel) + "' " + why);
  };
  if (rel.empty()) return bad("is empty");
  if (rel.front() == '/') return bad("is an absolute path; it must be relative to the checkpoint");
  if (rel.find('\\') != std::string_view::npos) return bad("contains a backslash");
  if (rel.find('\0') != std::string_view::npos) return bad("contains a NUL byte");
  size_t start = 0;
  while (start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string_view::npos) end = rel.size();
    std::string_view part = rel.substr(start, end - start);
    if (part.empty()) return bad("has an empty path component");
    if (part == "..") return bad("contains '..' and would escape the checkpoint folder");
    if (part == ".") return bad("contains a '.' component");
    start = end + 1;
  }
  return Status::Ok();
}

Result<fs::path> ResolveInside(const fs::path& root, std::string_view rel,
                               const std::string& what) {
  UCP_RETURN_IF_ERROR(ValidateRelativePath(rel, what));
  std::error_code ec;
  fs::path canon_root = fs::weakly_canonical(root, ec);
  if (ec) return DataLossError("cannot resolve checkpoint folder " + root.string());
  fs::path full = fs::weakly_canonical(root / fs::path(std::string(rel)), ec);
  if (ec) return DataLossError(what + " '" + std::string(rel) + "' cannot be resolved");
  // Component-wise prefix test: a symlink inside the folder must not lead outside it.
  auto r = canon_root.begin();
  auto f = full.begin();
  for (; r != canon_root.end(); ++r, ++f) {
    if (f == full.end() || *r != *f) {
      return DataLossError(what + " '" + std::string(rel) + "' resolves to " + full.string() +
                           ", outside the checkpoint folder " + canon_root.string());
    }
  }
  if (f == full.end())
    return DataLossError(what + " '" + std::string(rel) + "' names the folder itself");
  return full;
}

}  // namespace ucp::io
