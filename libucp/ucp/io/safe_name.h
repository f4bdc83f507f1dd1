// Safe file names for parameters, and the check that a relative path read from a manifest stays
// inside its checkpoint folder. No parameter name, however hostile, can name a file outside it.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "ucp/base/result.h"

namespace ucp::io {

/// Escapes a parameter name into one path component: bytes outside [A-Za-z0-9._-] become %XX
/// (uppercase hex), so the mapping is injective and the result has no '/'. Escaped names longer
/// than 200 bytes are cut to 183 bytes plus "~" and the 16-hex XXH3-64 of the full name.
/// Errors: kInvalidArgument for an empty name, "." or "..".
Result<std::string> EscapeName(std::string_view name);

/// The relative file of a parameter in a universal checkpoint: "params/<EscapeName(name)>.h5".
/// Errors: as EscapeName.
Result<std::string> ParamFileName(std::string_view name);

/// Checks a relative path read from a file: not empty, not absolute, '/'-separated components
/// that are neither empty, "." nor "..", no backslash or NUL. `what` names the field in errors.
/// Errors: kDataLoss naming `what` and the path.
Status ValidateRelativePath(std::string_view rel, const std::string& what);

/// ValidateRelativePath, then resolves `root/rel` (following symlinks that exist) and checks that
/// the result is still inside `root`.
/// Errors: kDataLoss naming `what` and the path.
Result<std::filesystem::path> ResolveInside(const std::filesystem::path& root, std::string_view rel,
                                            const std::string& what);

}  // namespace ucp::io
