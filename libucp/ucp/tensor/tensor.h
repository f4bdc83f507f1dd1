// Tensor (owning, contiguous) and TensorView / ConstTensorView (non-owning views over a caller's
// memory, e.g. a trainer's parameters). Always contiguous row-major; strided data is made
// contiguous by the reader that meets it, never silently here.
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/host_buffer.h"
#include "ucp/tensor/shape.h"

namespace ucp {

struct ConstTensorView {
  DType dtype = DType::kFp32;
  Shape shape;                       // logical dims, row-major
  std::span<const std::byte> bytes;  // exactly NumElements(shape) * DTypeSizeBytes(dtype)

  int64_t num_elements() const { return NumElementsOrDie(shape); }
  template <typename T>
  std::span<const T> as() const {
    return {reinterpret_cast<const T*>(bytes.data()), bytes.size() / sizeof(T)};
  }
};

struct TensorView {
  DType dtype = DType::kFp32;
  Shape shape;
  std::span<std::byte> bytes;

  int64_t num_elements() const { return NumElementsOrDie(shape); }
  operator ConstTensorView() const { return {dtype, shape, bytes}; }  // NOLINT
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(bytes.data()), bytes.size() / sizeof(T)};
  }
};

/// Checks that a view's byte count matches its dtype and shape.
/// Errors: kInvalidArgument naming `what` and both sizes.
Status ValidateView(const ConstTensorView& v, const std::string& what);

class Tensor {
 public:
  Tensor() = default;
  /// A zero-filled tensor. Errors: kDataLoss (shape overflow), kResourceExhausted.
  static Result<Tensor> Zeros(DType dtype, Shape shape);
  /// A tensor whose bytes are left uninitialised, for callers that overwrite all of them (readers):
  /// it skips the zero fill, which costs as much as the read itself on large tensors.
  /// Errors: as Zeros.
  static Result<Tensor> Uninitialized(DType dtype, Shape shape);
  /// A tensor holding a copy of `view`.
  static Result<Tensor> CopyOf(const ConstTensorView& view);

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t num_elements() const { return NumElementsOrDie(shape_); }
  int64_t num_bytes() const { return buffer_.num_bytes(); }
  std::byte* data() { return buffer_.data(); }
  const std::byte* data() const { return buffer_.data(); }
  TensorView view() { return {dtype_, shape_, buffer_.bytes()}; }
  ConstTensorView view() const { return {dtype_, shape_, buffer_.bytes()}; }
  template <typename T>
  std::span<T> as() { return buffer_.as<T>(); }
  template <typename T>
  std::span<const T> as() const { return buffer_.as<T>(); }

 private:
  static Result<Tensor> Make(DType dtype, Shape shape, bool zero_fill);

  DType dtype_ = DType::kFp32;
  Shape shape_;
  HostBuffer buffer_;
};

/// Bitwise equality of dtype, shape and bytes.
bool BitwiseEqual(const ConstTensorView& a, const ConstTensorView& b);

}  // namespace ucp
