// Reading the plain values DeepSpeed pickles (ints, floats, torch.Size, argparse.Namespace) out of
// the unpickler's PyValue tree with a named error for every wrong kind, and turning what JSON can
// represent into JSON. Shared by the DeepSpeed reader, source and writers.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "ucp/base/result.h"
#include "ucp/io/torch/py_value.h"
#include "ucp/tensor/shape.h"

namespace ucp::deepspeed {

/// An int (or bool). Errors: kNotFound when `v` is null, kDataLoss for another kind; both name
/// `what`.
Result<int64_t> AsInt(const torch::PyValue* v, std::string_view what);
/// A float or an int. Errors: as AsInt.
Result<double> AsDouble(const torch::PyValue* v, std::string_view what);
/// A torch.Size (tuple or list of non-negative ints). Errors: kDataLoss naming `what`.
Result<Shape> AsShape(const torch::PyValue* v, std::string_view what);
/// The attribute dict of an object pickled with its __dict__ (argparse.Namespace), or nullptr.
const torch::PyValue* ObjectState(const torch::PyValue* v);
/// Appends the JSON of the representable part of `v`: objects with a __dict__ become their
/// attributes; tensors, numpy RNG tuples and other opaque values become null; non-finite floats
/// null. Strings JSON cannot hold (a Python 2 pickle's byte strings, lone surrogates) and bytes
/// are kept losslessly as {"py/str": HEX} / {"py/bytes": HEX}, dict keys as "py/str:HEX"
/// (AppendJsonKey). Errors: kResourceExhausted when the text would pass 64 MiB (memo references
/// are shared in `v` but repeated in JSON).
[[nodiscard]] Status AppendJson(const torch::PyValue* v, std::string& out);
/// Appends `s` as a JSON string literal; `s` must be UTF-8 (names ucp made, or checked ones).
void AppendJsonString(std::string_view s, std::string& out);
/// Appends a dict key: escaped as "py/str:HEX" when it is not UTF-8 or starts with "py/".
void AppendJsonKey(std::string_view key, std::string& out);
/// The key AppendJsonKey escaped; nullopt for a malformed escape.
std::optional<std::string> UnescapeJsonKey(std::string_view key);
/// The bytes of a HEX escape; nullopt for a malformed one.
std::optional<std::string> UnescapeHex(std::string_view hex);
/// "[2, 3]".
std::string ShapeString(const Shape& s);
/// The rule-set folder: `option`, else env UCP_DATA_DIR + "/patterns", else the source tree's.
std::filesystem::path RuleSetDir(const std::filesystem::path& option);

}  // namespace ucp::deepspeed
