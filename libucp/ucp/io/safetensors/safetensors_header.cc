// Header parsing (strict_json, then one check per rule) and the crate-compatible serializer.
#include "ucp/io/safetensors/safetensors_header.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "ucp/base/check.h"
#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/json/strict_json.h"

namespace ucp::safetensors {

namespace {

using json::Json;

// Every dtype name the crate knows (HEAD, 0.8.0-dev), with its position in the crate's Dtype
// enum: the writer sorts by it, so it must follow the enum exactly. `dtype` is unset where ucp has
// no such dtype.
struct DTypeInfo {
  std::string_view name;
  int crate_rank;
  std::optional<DType> dtype;
};
constexpr std::array<DTypeInfo, 22> kDTypes = {{
    {"BOOL", 0, DType::kBool},         {"F4", 1, std::nullopt},
    {"F6_E2M3", 2, std::nullopt},      {"F6_E3M2", 3, std::nullopt},
    {"U8", 4, DType::kUint8},          {"I8", 5, DType::kInt8},
    {"F8_E5M2", 6, DType::kFp8E5m2},   {"F8_E4M3", 7, DType::kFp8E4m3},
    {"F8_E8M0", 8, std::nullopt},      {"F8_E4M3FNUZ", 9, std::nullopt},
    {"F8_E5M2FNUZ", 10, std::nullopt}, {"I16", 11, DType::kInt16},
    {"U16", 12, std::nullopt},         {"F16", 13, DType::kFp16},
    {"BF16", 14, DType::kBf16},        {"I32", 15, DType::kInt32},
    {"U32", 16, std::nullopt},         {"F32", 17, DType::kFp32},
    {"C64", 18, std::nullopt},         {"F64", 19, DType::kFp64},
    {"I64", 20, DType::kInt64},        {"U64", 21, std::nullopt},
}};

const DTypeInfo& InfoOf(DType d) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == d) return info;
  }
  UCP_CHECK(false) << "dtype " << DTypeName(d) << " has no safetensors name";
  return kDTypes[0];
}

std::string ShapeText(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string RangeText(int64_t begin, int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// A short description of a JSON value for messages: scalars as written, containers by type (a
// hostile header could make a dump as large as the header).
std::string Describe(const Json& j) {
  if (j.is_object() || j.is_array()) return std::string("a json ") + j.type_name();
  std::string text = j.dump();
  if (text.size() > 64) text = text.substr(0, 64) + "...";
  return text;
}

// A non-negative integer that fits int64 (nlohmann parses those as number_unsigned).
std::optional<int64_t> AsIndex(const Json& j) {
  if (!j.is_number_unsigned()) return std::nullopt;
  const uint64_t v = j.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return static_cast<int64_t>(v);
}

// A name as shown in messages: a hostile header can hold a name of 100 MB.
std::string Shown(const std::string& name) {
  return name.size() <= 200 ? name : name.substr(0, 200) + "...";
}

bool IsJsonSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

class HeaderParser {
 public:
  HeaderParser(const std::string& file) : prefix_("safetensors file " + file + ": ") {}

  Status Error(const std::string& what) const { return DataLossError(prefix_ + what); }
  Status TensorError(const std::string& name, const std::string& field,
                     const std::string& what) const {
    return DataLossError(prefix_ + "tensor '" + Shown(name) + "' field " + Shown(field) + ": " +
                         what);
  }

  Status ParseMetadata(const Json& j, std::map<std::string, std::string>& out) const {
    if (!j.is_object()) {
      return Error("field __metadata__ is " + Describe(j) + ", not an object of strings");
    }
    for (const auto& [key, value] : j.items()) {
      if (!value.is_string()) {
        return Error("field __metadata__ key '" + Shown(key) + "' is " + Describe(value) +
                     ", not a string");
      }
      out.emplace(key, value.get<std::string>());
    }
    return Status::Ok();
  }

  Result<SafetensorsEntry> ParseTensor(const std::string& name, const Json& j) const {
    if (!j.is_object()) {
      return DataLossError(prefix_ + "tensor '" + Shown(name) + "' is " + Describe(j) +
                           ", not an object");
    }
    for (const auto& [key, value] : j.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        return TensorError(name, key, "unknown field (only dtype, shape and data_offsets)");
      }
    }
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!j.contains(field)) return TensorError(name, field, "missing field");
    }
    SafetensorsEntry e;
    e.name = name;

    const Json& dtype = j.at("dtype");
    if (!dtype.is_string()) return TensorError(name, "dtype", Describe(dtype) + " is not a string");
    UCP_ASSIGN_OR_RETURN(
        e.dtype, DTypeFromSafetensorsName(dtype.get_ref<const std::string&>(),
                                          prefix_ + "tensor '" + Shown(name) + "' field dtype"));

    const Json& shape = j.at("shape");
    if (!shape.is_array()) return TensorError(name, "shape", Describe(shape) + " is not an array");
    if (static_cast<int64_t>(shape.size()) > kMaxRank) {
      return UnimplementedError(
          prefix_ + "tensor '" + Shown(name) + "' field shape: " + std::to_string(shape.size()) +
          " dims, more than the " + std::to_string(kMaxRank) + " ucp supports");
    }
    for (size_t i = 0; i < shape.size(); ++i) {
      std::optional<int64_t> dim = AsIndex(shape[i]);
      if (!dim) {
        return TensorError(name, "shape",
                           "dim " + std::to_string(i) + " is " + Describe(shape[i]) +
                               ", not an integer in [0, 2^63)");
      }
      e.shape.push_back(*dim);
    }
    std::optional<int64_t> expected_bytes;
    {
      auto count = NumElements(e.shape, "shape");
      if (count.ok()) expected_bytes = CheckedMul(*count, DTypeSizeBytes(e.dtype));
    }
    if (!expected_bytes) {
      return TensorError(name, "shape",
                         ShapeText(e.shape) + " of " + std::string(SafetensorsDTypeName(e.dtype)) +
                             " has a byte size that overflows int64");
    }

    const Json& offsets = j.at("data_offsets");
    std::optional<int64_t> begin, end;
    if (offsets.is_array() && offsets.size() == 2) {
      begin = AsIndex(offsets[0]);
      end = AsIndex(offsets[1]);
    }
    if (!begin || !end) {
      return TensorError(
          name, "data_offsets",
          "must be [begin, end] with two integers in [0, 2^63), got " +
              (offsets.is_array() && offsets.size() <= 2 ? offsets.dump() : Describe(offsets)));
    }
    e.data_begin = *begin;
    e.data_end = *end;
    if (e.data_end < e.data_begin) {
      return TensorError(name, "data_offsets",
                         RangeText(e.data_begin, e.data_end) + " ends before it begins");
    }
    if (e.num_bytes() != *expected_bytes) {
      return TensorError(name, "data_offsets",
                         RangeText(e.data_begin, e.data_end) + " holds " +
                             std::to_string(e.num_bytes()) + " bytes but shape " +
                             ShapeText(e.shape) + " of " +
                             std::string(SafetensorsDTypeName(e.dtype)) + " needs " +
                             std::to_string(*expected_bytes) + " bytes");
    }
    return e;
  }

  // Sorted by offset, the tensors must cover [0, data_size_bytes) exactly once.
  Status CheckTiling(std::vector<SafetensorsEntry>& entries, int64_t data_size_bytes) const {
    std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
      return std::tie(a.data_begin, a.data_end, a.name) <
             std::tie(b.data_begin, b.data_end, b.name);
    });
    int64_t covered = 0;
    const SafetensorsEntry* previous = nullptr;
    for (const SafetensorsEntry& e : entries) {
      if (e.data_begin > covered) {
        return TensorError(e.name, "data_offsets",
                           RangeText(e.data_begin, e.data_end) + " leaves a hole of " +
                               std::to_string(e.data_begin - covered) + " bytes before it (" +
                               (previous ? "tensor '" + Shown(previous->name) + "' ends at "
                                         : std::string("the data area starts at ")) +
                               std::to_string(covered) + ")");
      }
      if (e.data_begin < covered) {
        return TensorError(e.name, "data_offsets",
                           RangeText(e.data_begin, e.data_end) + " overlaps tensor '" +
                               Shown(previous->name) + "' " +
                               RangeText(previous->data_begin, previous->data_end));
      }
      covered = e.data_end;
      previous = &e;
    }
    if (covered > data_size_bytes) {
      return TensorError(previous->name, "data_offsets",
                         RangeText(previous->data_begin, previous->data_end) +
                             " ends past the end of the data area (" +
                             std::to_string(data_size_bytes) + " bytes): the file is truncated");
    }
    if (covered < data_size_bytes) {
      return Error(std::to_string(data_size_bytes - covered) +
                   " trailing bytes after the last tensor (the data area is " +
                   std::to_string(data_size_bytes) + " bytes, the tensors end at " +
                   std::to_string(covered) + ")");
    }
    return Status::Ok();
  }

 private:
  std::string prefix_;
};

// JSON string escaping exactly as serde_json writes it: '"', '\\' and the C0 controls, with the
// short forms \b \t \n \f \r and \u00xx (lowercase hex) for the rest; everything else (non-ASCII
// included) verbatim.
void AppendJsonString(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += kHex[u >> 4];
          out += kHex[u & 0xf];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

}  // namespace

bool IsValidUtf8(std::string_view text, size_t* bad_offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  auto fail = [&] {
    if (bad_offset) *bad_offset = i;
    return false;
  };
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return fail();
    }
    if (n - i < len) return fail();
    if (p[i + 1] < lo || p[i + 1] > hi) return fail();
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return fail();
    }
    i += len;
  }
  return true;
}

std::string_view SafetensorsDTypeName(DType dtype) { return InfoOf(dtype).name; }

Result<DType> DTypeFromSafetensorsName(std::string_view name, const std::string& what) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name != name) continue;
    if (!info.dtype) {
      return UnimplementedError(what + ": safetensors dtype '" + std::string(name) +
                                "' is not supported by ucp");
    }
    return *info.dtype;
  }
  std::string shown(name.substr(0, 64));
  return DataLossError(what + ": unknown dtype '" + shown + "'");
}

Result<int64_t> ParseHeaderSize(std::span<const std::byte> first_bytes, int64_t file_size_bytes,
                                const std::string& file, int64_t max_header_bytes) {
  const std::string prefix = "safetensors file " + file + ": ";
  if (file_size_bytes < kHeaderSizeBytes || first_bytes.size() < kHeaderSizeBytes) {
    return DataLossError(prefix + "the file is " + std::to_string(file_size_bytes) +
                         " bytes, shorter than the 8-byte header size");
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | std::to_integer<uint64_t>(first_bytes[i]);
  if (n > static_cast<uint64_t>(max_header_bytes)) {
    return DataLossError(prefix + "header size " + std::to_string(n) +
                         " bytes exceeds the limit of " + std::to_string(max_header_bytes) +
                         " bytes");
  }
  const auto header_bytes = static_cast<int64_t>(n);
  if (header_bytes > file_size_bytes - kHeaderSizeBytes) {
    return DataLossError(prefix + "header size " + std::to_string(header_bytes) +
                         " bytes reaches past the end of the file (" +
                         std::to_string(file_size_bytes) + " bytes)");
  }
  return header_bytes;
}

Result<SafetensorsHeader> ParseHeader(std::span<const std::byte> header_bytes,
                                      int64_t file_size_bytes, const std::string& file) {
  const HeaderParser parser(file);
  const std::string_view text(reinterpret_cast<const char*>(header_bytes.data()),
                              header_bytes.size());
  SafetensorsHeader h;
  h.header_size_bytes = static_cast<int64_t>(text.size());
  h.data_size_bytes = file_size_bytes - kHeaderSizeBytes - h.header_size_bytes;
  UCP_CHECK(h.data_size_bytes >= 0) << "ParseHeader called with a header past the file end";

  size_t bad = 0;
  if (!IsValidUtf8(text, &bad)) {
    return parser.Error("header is not valid utf-8 (byte " + std::to_string(bad) + " of " +
                        std::to_string(text.size()) + ")");
  }
  // No valid JSON text holds a raw NUL (inside strings it must be escaped), and nlohmann's lexer
  // takes one for the end of its input: "{}\0<anything>" would parse. Refused outright.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return parser.Error("header holds a nul byte at byte " + std::to_string(nul) + " of " +
                        std::to_string(text.size()));
  }
  // JSON whitespace may precede the object (the crate accepts it), but nothing else: this also
  // refuses a byte-order mark, which nlohmann would skip and serde_json would not.
  const size_t first = std::find_if_not(text.begin(), text.end(), IsJsonSpace) - text.begin();
  if (first == text.size() || text[first] != '{') {
    return parser.Error(
        "header is not a json object (" +
        (first == text.size()
             ? std::string("it is empty or blank")
             : "it starts with byte " + std::to_string(static_cast<unsigned char>(text[first]))) +
        ")");
  }
  // Valid headers nest 3 deep (header, tensor, shape).
  UCP_ASSIGN_OR_RETURN(const Json root,
                       json::ParseStrict(text, "safetensors file " + file + ": header",
                                         StatusCode::kDataLoss, /*max_depth=*/8));
  if (!root.is_object()) return parser.Error("header is not a json object");

  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      h.metadata.emplace();
      UCP_RETURN_IF_ERROR(parser.ParseMetadata(value, *h.metadata));
      continue;
    }
    UCP_ASSIGN_OR_RETURN(SafetensorsEntry e, parser.ParseTensor(key, value));
    h.entries.push_back(std::move(e));
  }
  UCP_RETURN_IF_ERROR(parser.CheckTiling(h.entries, h.data_size_bytes));
  return h;
}

Result<SafetensorsLayout> LayOut(
    std::span<const SafetensorsTensorSpec> tensors,
    const std::optional<std::map<std::string, std::string>>& metadata) {
  SafetensorsLayout layout;
  std::set<std::string_view> names;
  for (const SafetensorsTensorSpec& t : tensors) {
    const std::string what = "safetensors tensor '" + t.name + "'";
    if (t.name.empty()) return InvalidArgumentError("safetensors tensor names must not be empty");
    if (t.name == kMetadataKey) {
      return InvalidArgumentError(what + ": the name is reserved for the metadata map");
    }
    if (!IsValidUtf8(t.name)) return InvalidArgumentError(what + ": the name is not valid utf-8");
    if (!names.insert(t.name).second) return InvalidArgumentError(what + " is given twice");
    if (static_cast<int64_t>(t.shape.size()) > kMaxRank) {
      return InvalidArgumentError(what + " has " + std::to_string(t.shape.size()) +
                                  " dims, more than " + std::to_string(kMaxRank));
    }
    auto count = NumElements(t.shape, what + " shape");
    if (!count.ok()) return InvalidArgumentError(count.status().message());
    auto bytes = CheckedMul(*count, DTypeSizeBytes(t.dtype));
    if (!bytes) return InvalidArgumentError(what + ": the byte size overflows int64");
    layout.entries.push_back({t.name, t.dtype, t.shape, 0, *bytes});
  }
  if (metadata) {
    for (const auto& [k, v] : *metadata) {
      if (!IsValidUtf8(k) || !IsValidUtf8(v)) {
        return InvalidArgumentError("safetensors metadata key '" + k +
                                    "': key or value is not valid utf-8");
      }
    }
  }
  // The crate's prepare(): dtype descending in enum order (largest alignment first), then name.
  std::sort(layout.entries.begin(), layout.entries.end(), [](const auto& a, const auto& b) {
    const int ra = InfoOf(a.dtype).crate_rank, rb = InfoOf(b.dtype).crate_rank;
    if (ra != rb) return ra > rb;
    return a.name < b.name;
  });
  int64_t offset = 0;
  for (SafetensorsEntry& e : layout.entries) {
    const int64_t n = e.data_end;
    auto end = CheckedAdd(offset, n);
    if (!end) return InvalidArgumentError("safetensors tensors' total byte size overflows int64");
    e.data_begin = offset;
    e.data_end = *end;
    offset = *end;
  }
  layout.data_size_bytes = offset;

  std::string& out = layout.prefix;
  out.assign(kHeaderSizeBytes, '\0');
  out += '{';
  bool first = true;
  if (metadata) {
    AppendJsonString(out, kMetadataKey);
    out += ":{";
    for (const auto& [k, v] : *metadata) {
      if (!first) out += ',';
      first = false;
      AppendJsonString(out, k);
      out += ':';
      AppendJsonString(out, v);
    }
    out += '}';
    first = false;
  }
  for (const SafetensorsEntry& e : layout.entries) {
    if (!first) out += ',';
    first = false;
    AppendJsonString(out, e.name);
    out += ":{\"dtype\":";
    AppendJsonString(out, SafetensorsDTypeName(e.dtype));
    out += ",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) {
      if (i > 0) out += ',';
      out += std::to_string(e.shape[i]);
    }
    out += "],\"data_offsets\":[" + std::to_string(e.data_begin) + "," +
           std::to_string(e.data_end) + "]}";
  }
  out += '}';
  // Space padding to a multiple of 8 keeps the data area, and with the dtype ordering every
  // tensor, naturally aligned when the file is mapped.
  out.resize(RoundUp(static_cast<int64_t>(out.size()), 8), ' ');
  const auto n = static_cast<uint64_t>(out.size()) - kHeaderSizeBytes;
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return ResourceExhaustedError("safetensors header would be " + std::to_string(n) +
                                  " bytes, more than the " + std::to_string(kMaxHeaderBytes) +
                                  " bytes readers accept");
  }
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return layout;
}

}  // namespace ucp::safetensors
