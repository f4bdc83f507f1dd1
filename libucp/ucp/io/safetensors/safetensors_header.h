// The safetensors header: an 8-byte little-endian size N, then N bytes of UTF-8 JSON naming each
// tensor's dtype, shape and byte range in the data area that follows. This file parses and
// validates a header (the reader and the fuzzer share it) and serializes one exactly as the
// reference crate does (the writer uses it), so that files match `safetensors.torch.save_file`
// byte for byte. Rules and errors: docs/safetensors_format.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"
#include "ucp/tensor/dtype.h"
#include "ucp/tensor/shape.h"

namespace ucp::safetensors {

/// The crate's MAX_HEADER_SIZE: larger headers are refused before anything is allocated.
inline constexpr int64_t kMaxHeaderBytes = 100'000'000;
/// Bytes of the little-endian u64 header size at the start of every file.
inline constexpr int64_t kHeaderSizeBytes = 8;
/// Most dims a tensor may have (as torch). The crate has no limit; none has been seen in practice.
inline constexpr int64_t kMaxRank = 64;
/// The reserved header key of the string→string metadata map.
inline constexpr std::string_view kMetadataKey = "__metadata__";

/// One tensor as the header describes it. Offsets are relative to the start of the data area
/// (file offset 8 + N), `data_end` exclusive.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kFp32;
  Shape shape;  // row-major; [] is a 0-d tensor of one element
  int64_t data_begin = 0;
  int64_t data_end = 0;

  int64_t num_bytes() const { return data_end - data_begin; }
  friend bool operator==(const SafetensorsEntry&, const SafetensorsEntry&) = default;
};

/// A validated header.
struct SafetensorsHeader {
  /// In file order: sorted by data_begin (ties, possible only between empty tensors, by
  /// data_end then name). They tile [0, data_size_bytes) exactly.
  std::vector<SafetensorsEntry> entries;
  /// `__metadata__`, when the header has one (keys sorted).
  std::optional<std::map<std::string, std::string>> metadata;
  /// N: the JSON text's length in bytes, padding included.
  int64_t header_size_bytes = 0;
  /// Bytes after the header: file size - 8 - N.
  int64_t data_size_bytes = 0;

  /// File offset of the data area.
  int64_t data_offset() const { return kHeaderSizeBytes + header_size_bytes; }
};

/// The crate's name of a ucp dtype: "F32", "BF16", "F8_E4M3", "BOOL", ...
std::string_view SafetensorsDTypeName(DType dtype);

/// Maps a header dtype name. `what` prefixes errors.
/// Errors: kUnimplemented naming the dtype for the crate's dtypes ucp does not hold (U16, U32,
/// U64, F4, F6_E2M3, F6_E3M2, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, C64); kDataLoss "unknown dtype"
/// for any other name.
Result<DType> DTypeFromSafetensorsName(std::string_view name, const std::string& what);

/// Reads N from the first 8 bytes of a file of `file_size_bytes` bytes and checks it against
/// `max_header_bytes` and the file size. `file` names the file in errors.
/// Errors: kDataLoss when the file is shorter than 8 bytes, N exceeds max_header_bytes, or
/// 8 + N is past the end of the file.
Result<int64_t> ParseHeaderSize(std::span<const std::byte> first_bytes, int64_t file_size_bytes,
                                const std::string& file,
                                int64_t max_header_bytes = kMaxHeaderBytes);

/// Parses and validates the N header bytes of a file of `file_size_bytes` bytes: UTF-8, one JSON
/// object (leading and trailing JSON whitespace allowed, so the writer's space padding is), no
/// duplicate keys, `__metadata__` a string→string object, every other key a tensor object with
/// exactly dtype, shape and data_offsets, shape and offset arithmetic checked, and the offsets
/// tiling the data area with no hole, overlap or trailing byte.
/// Errors: kDataLoss naming `file`, the tensor and the field, one message per rule
/// (docs/safetensors_format.md); kUnimplemented for a known dtype ucp does not hold.
Result<SafetensorsHeader> ParseHeader(std::span<const std::byte> header_bytes,
                                      int64_t file_size_bytes, const std::string& file);

/// What a writer lays out: a name, a dtype and a shape.
struct SafetensorsTensorSpec {
  std::string name;
  DType dtype = DType::kFp32;
  Shape shape;
};

/// The layout the reference writer (`prepare()` in the crate) gives `tensors`: sorted by dtype
/// alignment, largest first (the crate's Dtype enum, descending), then by name bytewise, laid out
/// back to back from offset 0; and the serialized header, compact JSON with `__metadata__` first
/// (its keys sorted, where the crate's HashMap order is arbitrary), padded with spaces to a
/// multiple of 8 bytes. The returned bytes are the whole file prefix: 8-byte N, then the header.
struct SafetensorsLayout {
  std::vector<SafetensorsEntry> entries;  // file order
  std::string prefix;                     // 8 + N bytes
  int64_t data_size_bytes = 0;
};

/// Errors: kInvalidArgument for an empty, duplicate, `__metadata__` or non-UTF-8 name, a
/// non-UTF-8 metadata key or value, a negative dim, more than kMaxRank dims, or a size that
/// overflows int64; kResourceExhausted when the header would exceed kMaxHeaderBytes.
Result<SafetensorsLayout> LayOut(std::span<const SafetensorsTensorSpec> tensors,
                                 const std::optional<std::map<std::string, std::string>>& metadata);

/// True when `text` is valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF,
/// as Rust's str::from_utf8). Sets `*bad_offset` to the first invalid byte otherwise.
bool IsValidUtf8(std::string_view text, size_t* bad_offset = nullptr);

}  // namespace ucp::safetensors
