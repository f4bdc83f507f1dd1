#include "ucp/base/checked_math.h"

namespace ucp {

Result<int64_t> CheckedProduct(std::span<const int64_t> dims, const std::string& what) {
  int64_t n = 1;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] < 0) {
      return DataLossError(what + ": dimension " + std::to_string(i) + " is negative (" +
                           std::to_string(dims[i]) + ")");
    }
    auto next = CheckedMul(n, dims[i]);
    if (!next) return DataLossError(what + ": element count overflows int64");
    n = *next;
  }
  return n;
}

}  // namespace ucp
