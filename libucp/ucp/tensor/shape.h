// Shape: dims in elements, row-major (C order). Sizes read from files are checked before use.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ucp/base/result.h"

namespace ucp {

using Shape = std::vector<int64_t>;

/// Product of dims; kDataLoss naming `what` on a negative dim or int64 overflow.
Result<int64_t> NumElements(std::span<const int64_t> shape, const std::string& what = "shape");
/// Product of dims for a shape already validated; aborts on overflow (a bug then).
int64_t NumElementsOrDie(std::span<const int64_t> shape);
/// Row-major strides in elements.
std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape);
/// "[4, 1024]".
std::string ShapeToString(std::span<const int64_t> shape);

}  // namespace ucp
