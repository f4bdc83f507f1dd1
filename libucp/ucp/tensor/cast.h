// Element casts between dtypes. Same dtype is a byte copy. Between floating types the result is
// the nearest value, ties to even (one rounding: fp64 sources are not rounded through fp32).
// Integer and bool casts are exact or refused: a value that does not fit is an error.
#pragma once

#include <cstddef>
#include <span>

#include "ucp/base/status.h"
#include "ucp/tensor/dtype.h"

namespace ucp {

/// Converts num_elements from src (dtype src_dtype) to dst (dtype dst_dtype).
/// Float -> int is refused (checkpoints never need it and it cannot be exact in general).
/// Errors: kInvalidArgument (span sizes wrong), kOutOfRange (an integer value does not fit the
/// target, naming the element index), kUnimplemented (float -> integer or bool).
Status CastElements(DType src_dtype, std::span<const std::byte> src, DType dst_dtype,
                    std::span<std::byte> dst, int64_t num_elements);

}  // namespace ucp
