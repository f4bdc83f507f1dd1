#include "ucp/tensor/shape.h"

#include "ucp/base/checked_math.h"

namespace ucp {

Result<int64_t> NumElements(std::span<const int64_t> shape, const std::string& what) {
  return CheckedProduct(shape, what);
}

int64_t NumElementsOrDie(std::span<const int64_t> shape) {
  Result<int64_t> n = CheckedProduct(shape, "shape");
  UCP_CHECK(n.ok()) << n.status().ToString();
  return *n;
}

std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) strides[i - 1] = strides[i] * shape[i];
  return strides;
}

std::string ShapeToString(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace ucp
