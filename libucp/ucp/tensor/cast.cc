#include "ucp/tensor/cast.h"

#include <cstring>
#include <limits>
#include <string>

#include "ucp/base/checked_math.h"
#include "ucp/tensor/float_bits.h"

namespace ucp {
namespace {

template <typename T>
T Load(const std::byte* p, int64_t i) {
  T v;
  std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}
template <typename T>
void Store(std::byte* p, int64_t i, T v) {
  std::memcpy(p + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

double LoadFloat(DType d, const std::byte* p, int64_t i) {
  switch (d) {
    case DType::kFp64: return Load<double>(p, i);
    case DType::kFp32: return Load<float>(p, i);
    case DType::kFp16: return Fp16Format::ToDouble(Load<uint16_t>(p, i));
    case DType::kBf16: return FloatFromBf16(Load<uint16_t>(p, i));
    case DType::kFp8E4m3: return Fp8E4m3Format::ToDouble(Load<uint8_t>(p, i));
    case DType::kFp8E5m2: return Fp8E5m2Format::ToDouble(Load<uint8_t>(p, i));
    default: break;
  }
  UCP_CHECK(false) << "not a float dtype: " << DTypeName(d);
  return 0;
}

// Stores a double with one rounding to the target float format.
void StoreFloat(DType d, std::byte* p, int64_t i, double v) {
  switch (d) {
    case DType::kFp64: Store<double>(p, i, v); return;
    case DType::kFp32: Store<float>(p, i, static_cast<float>(v)); return;
    case DType::kFp16: Store<uint16_t>(p, i, static_cast<uint16_t>(Fp16Format::FromDouble(v))); return;
    case DType::kBf16: Store<uint16_t>(p, i, static_cast<uint16_t>(Bf16Format::FromDouble(v))); return;
    case DType::kFp8E4m3: Store<uint8_t>(p, i, static_cast<uint8_t>(Fp8E4m3Format::FromDouble(v))); return;
    case DType::kFp8E5m2: Store<uint8_t>(p, i, static_cast<uint8_t>(Fp8E5m2Format::FromDouble(v))); return;
    default: break;
  }
  UCP_CHECK(false) << "not a float dtype: " << DTypeName(d);
}

int64_t LoadInt(DType d, const std::byte* p, int64_t i) {
  switch (d) {
    case DType::kInt8: return Load<int8_t>(p, i);
    case DType::kInt16: return Load<int16_t>(p, i);
    case DType::kInt32: return Load<int32_t>(p, i);
    case DType::kInt64: return Load<int64_t>(p, i);
    case DType::kUint8: return Load<uint8_t>(p, i);
    case DType::kBool: return Load<uint8_t>(p, i) != 0;
    default: break;
  }
  UCP_CHECK(false) << "not an integer dtype: " << DTypeName(d);
  return 0;
}

bool StoreInt(DType d, std::byte* p, int64_t i, int64_t v) {
  auto fits = [v](auto lo, auto hi) { return v >= lo && v <= hi; };
  switch (d) {
    case DType::kInt8:
      if (!fits(INT8_MIN, INT8_MAX)) return false;
      Store<int8_t>(p, i, static_cast<int8_t>(v));
      return true;
    case DType::kInt16:
      if (!fits(INT16_MIN, INT16_MAX)) return false;
      Store<int16_t>(p, i, static_cast<int16_t>(v));
      return true;
    case DType::kInt32:
      if (!fits(INT32_MIN, INT32_MAX)) return false;
      Store<int32_t>(p, i, static_cast<int32_t>(v));
      return true;
    case DType::kInt64: Store<int64_t>(p, i, v); return true;
    case DType::kUint8:
      if (!fits(0, UINT8_MAX)) return false;
      Store<uint8_t>(p, i, static_cast<uint8_t>(v));
      return true;
    case DType::kBool:
      if (!fits(0, 1)) return false;
      Store<uint8_t>(p, i, static_cast<uint8_t>(v));
      return true;
    default: break;
  }
  UCP_CHECK(false) << "not an integer dtype: " << DTypeName(d);
  return false;
}

}  // namespace

Status CastElements(DType src_dtype, std::span<const std::byte> src, DType dst_dtype,
                    std::span<std::byte> dst, int64_t num_elements) {
  auto src_bytes = CheckedMul(num_elements, DTypeSizeBytes(src_dtype));
  auto dst_bytes = CheckedMul(num_elements, DTypeSizeBytes(dst_dtype));
  if (!src_bytes || !dst_bytes || static_cast<int64_t>(src.size()) < *src_bytes ||
      static_cast<int64_t>(dst.size()) < *dst_bytes) {
    return InvalidArgumentError("cast " + std::string(DTypeName(src_dtype)) + " -> " +
                                std::string(DTypeName(dst_dtype)) + " of " +
                                std::to_string(num_elements) + " elements: buffers too small (" +
                                std::to_string(src.size()) + " and " + std::to_string(dst.size()) +
                                " bytes)");
  }
  if (num_elements == 0) return Status::Ok();
  if (src_dtype == dst_dtype) {
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(*src_bytes));
    return Status::Ok();
  }
  const std::byte* s = src.data();
  std::byte* d = dst.data();
  bool src_float = IsFloating(src_dtype);
  bool dst_float = IsFloating(dst_dtype);
  if (src_float && !dst_float) {
    return UnimplementedError("cast " + std::string(DTypeName(src_dtype)) + " -> " +
                              std::string(DTypeName(dst_dtype)) +
                              " is refused: a float to integer cast is not exact");
  }
  // The hot pairs get direct loops; everything else goes through double / int64.
  if (src_dtype == DType::kFp32 && dst_dtype == DType::kBf16) {
    for (int64_t i = 0; i < num_elements; ++i) Store<uint16_t>(d, i, Bf16FromFloat(Load<float>(s, i)));
    return Status::Ok();
  }
  if (src_dtype == DType::kBf16 && dst_dtype == DType::kFp32) {
    for (int64_t i = 0; i < num_elements; ++i) Store<float>(d, i, FloatFromBf16(Load<uint16_t>(s, i)));
    return Status::Ok();
  }
  if (src_float) {
    for (int64_t i = 0; i < num_elements; ++i) StoreFloat(dst_dtype, d, i, LoadFloat(src_dtype, s, i));
    return Status::Ok();
  }
  if (dst_float) {
    // Integers up to 2^53 are exact in double, so this is one rounding; beyond that a narrow
    // target may see two (documented in docs/format.md).
    for (int64_t i = 0; i < num_elements; ++i) {
      int64_t v = LoadInt(src_dtype, s, i);
      if (dst_dtype == DType::kFp32) {
        Store<float>(d, i, static_cast<float>(v));
      } else {
        StoreFloat(dst_dtype, d, i, static_cast<double>(v));
      }
    }
    return Status::Ok();
  }
  for (int64_t i = 0; i < num_elements; ++i) {
    int64_t v = LoadInt(src_dtype, s, i);
    if (!StoreInt(dst_dtype, d, i, v)) {
      return OutOfRangeError("cast " + std::string(DTypeName(src_dtype)) + " -> " +
                             std::string(DTypeName(dst_dtype)) + ": element " + std::to_string(i) +
                             " (" + std::to_string(v) + ") does not fit");
    }
  }
  return Status::Ok();
}

}  // namespace ucp
