// DType: the element types a checkpoint can hold, by name. Generated from dtype_list.inc.
#pragma once

#include <array>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "ucp/base/result.h"

namespace ucp {

enum class DType : uint8_t {
#define UCP_DTYPE(e, name, bits, kind, torch) e,
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
};

enum class DTypeKind : uint8_t { kFloat, kSignedInt, kUnsignedInt, kBool };

/// Every dtype, in list order; tests sweep this so a new dtype is covered automatically.
inline constexpr std::array kAllDTypes = {
#define UCP_DTYPE(e, name, bits, kind, torch) DType::e,
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
};

/// The canonical name stored on disk: "fp32", "bf16", "fp8_e4m3", "int64", ...
std::string_view DTypeName(DType d);
/// PyTorch's name without the "torch." prefix: "float32", "bfloat16", "float8_e4m3fn", ...
std::string_view DTypeTorchName(DType d);
/// Bits per element (8 for bool).
int DTypeSizeBits(DType d);
/// Bytes per element.
inline int64_t DTypeSizeBytes(DType d) { return DTypeSizeBits(d) / 8; }
DTypeKind DTypeKindOf(DType d);
inline bool IsFloating(DType d) { return DTypeKindOf(d) == DTypeKind::kFloat; }

/// Parses a canonical name; also accepts torch's names and the common aliases used on command
/// lines ("float32", "float", "half", "bfloat16", "fp8"... are not guessed: only exact aliases).
/// Errors: kInvalidArgument naming the unknown dtype.
Result<DType> DTypeFromName(std::string_view name);

std::ostream& operator<<(std::ostream& os, DType d);

}  // namespace ucp
