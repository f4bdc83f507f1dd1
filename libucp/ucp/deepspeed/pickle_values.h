// Reading the plain values DeepSpeed pickles (ints, floats, torch.Size, argparse.Namespace) out of
// the unpickler's PyValue tree with a named error for every wrong kind, and turning what JSON can
// represent into JSON. Shared by the DeepSpeed reader, source and writers.
#pragma once

#include <cstdint>
#include <filesystem>
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
/// attributes; tensors, numpy RNG tuples and other opaque values become null.
void AppendJson(const torch::PyValue* v, std::string& out, int depth = 0);
/// Appends `s` as a JSON string literal.
void AppendJsonString(std::string_view s, std::string& out);
/// "[2, 3]".
std::string ShapeString(const Shape& s);
/// The rule-set folder: `option`, else env UCP_DATA_DIR + "/patterns", else the source tree's.
std::filesystem::path RuleSetDir(const std::filesystem::path& option);

}  // namespace ucp::deepspeed
