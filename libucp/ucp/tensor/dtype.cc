#include "ucp/tensor/dtype.h"

namespace ucp {

std::string_view DTypeName(DType d) {
  switch (d) {
#define UCP_DTYPE(e, name, bits, kind, torch) \
  case DType::e:                              \
    return name;
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
  }
  UCP_CHECK(false) << "bad dtype " << static_cast<int>(d);
  return {};
}

std::string_view DTypeTorchName(DType d) {
  switch (d) {
#define UCP_DTYPE(e, name, bits, kind, torch) \
  case DType::e:                              \
    return torch;
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
  }
  UCP_CHECK(false) << "bad dtype " << static_cast<int>(d);
  return {};
}

int DTypeSizeBits(DType d) {
  switch (d) {
#define UCP_DTYPE(e, name, bits, kind, torch) \
  case DType::e:                              \
    return bits;
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
  }
  UCP_CHECK(false) << "bad dtype " << static_cast<int>(d);
  return 0;
}

DTypeKind DTypeKindOf(DType d) {
  switch (d) {
#define UCP_DTYPE(e, name, bits, kind, torch) \
  case DType::e:                              \
    return DTypeKind::kind;
#include "ucp/tensor/dtype_list.inc"
#undef UCP_DTYPE
  }
  UCP_CHECK(false) << "bad dtype " << static_cast<int>(d);
  return DTypeKind::kFloat;
}

Result<DType> DTypeFromName(std::string_view name) {
  for (DType d : kAllDTypes) {
    if (name == DTypeName(d) || name == DTypeTorchName(d)) return d;
  }
  // Exact aliases people type; nothing is inferred from a prefix.
  if (name == "float" || name == "f32") return DType::kFp32;
  if (name == "double" || name == "f64") return DType::kFp64;
  if (name == "half" || name == "f16") return DType::kFp16;
  if (name == "bfloat16" || name == "bf16") return DType::kBf16;
  if (name == "long") return DType::kInt64;
  if (name == "int") return DType::kInt32;
  return InvalidArgumentError("unknown dtype \"" + std::string(name) +
                              "\" (known: fp64, fp32, fp16, bf16, fp8_e4m3, fp8_e5m2, int8, "
                              "int16, int32, int64, uint8, bool)");
}

std::ostream& operator<<(std::ostream& os, DType d) { return os << DTypeName(d); }

}  // namespace ucp
