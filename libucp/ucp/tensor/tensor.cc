#include "ucp/tensor/tensor.h"

#include <cstring>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"

namespace ucp {

Status ValidateView(const ConstTensorView& v, const std::string& what) {
  UCP_ASSIGN_OR_RETURN(int64_t n, NumElements(v.shape, what));
  auto expected = CheckedMul(n, DTypeSizeBytes(v.dtype));
  if (!expected) return InvalidArgumentError(what + ": byte count overflows int64");
  if (static_cast<int64_t>(v.bytes.size()) != *expected) {
    return InvalidArgumentError(what + ": view holds " + std::to_string(v.bytes.size()) +
                                " bytes but " + std::string(DTypeName(v.dtype)) + " " +
                                ShapeToString(v.shape) + " needs " + std::to_string(*expected));
  }
  return Status::Ok();
}

Result<Tensor> Tensor::Zeros(DType dtype, Shape shape) {
  return Make(dtype, std::move(shape), /*zero_fill=*/true);
}

Result<Tensor> Tensor::Uninitialized(DType dtype, Shape shape) {
  return Make(dtype, std::move(shape), /*zero_fill=*/false);
}

Result<Tensor> Tensor::Make(DType dtype, Shape shape, bool zero_fill) {
  UCP_ASSIGN_OR_RETURN(int64_t n, NumElements(shape, "tensor"));
  auto bytes = CheckedMul(n, DTypeSizeBytes(dtype));
  if (!bytes) return DataLossError("tensor byte count overflows int64");
  Tensor t;
  UCP_ASSIGN_OR_RETURN(t.buffer_, HostBuffer::Allocate(*bytes, zero_fill));
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  return t;
}

Result<Tensor> Tensor::CopyOf(const ConstTensorView& view) {
  UCP_RETURN_IF_ERROR(ValidateView(view, "tensor"));
  UCP_ASSIGN_OR_RETURN(Tensor t, Zeros(view.dtype, view.shape));
  if (!view.bytes.empty()) std::memcpy(t.data(), view.bytes.data(), view.bytes.size());
  return t;
}

bool BitwiseEqual(const ConstTensorView& a, const ConstTensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes.size() == b.bytes.size() &&
         (a.bytes.empty() || std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0);
}

}  // namespace ucp
