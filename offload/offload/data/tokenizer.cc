// The byte tokenizer: validation is the only work (strict UTF-8 per RFC 3629: no overlong forms,
// no surrogates, nothing above U+10FFFF), because a token is a byte.
#include "offload/data/tokenizer.h"

#include <algorithm>
#include <cstdio>

#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"

namespace ucp::offload {
namespace {

std::string Hex(unsigned char b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "0x%02X", b);
  return buf;
}

// The length of the valid UTF-8 sequence at text[i], or 0 when it is invalid there.
size_t ValidSequenceLength(std::string_view text, size_t i) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = at(i);
  if (b0 < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // overlong
    if (b0 == 0xED) hi = 0x9F;  // surrogates U+D800..U+DFFF
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;  // overlong
    if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;  // a continuation byte, an overlong lead (0xC0, 0xC1) or 0xF5..0xFF
  }
  if (text.size() - i < len) return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  }
  return len;
}

}  // namespace

Status ValidateDocumentText(std::string_view text, std::string_view where) {
  for (size_t i = 0; i < text.size();) {
    if (text[i] == '\0') {
      return InvalidArgumentError(std::string(where) + ": NUL byte at byte offset " +
                                  std::to_string(i) + " (NUL is the end-of-text token)");
    }
    const size_t len = ValidSequenceLength(text, i);
    if (len == 0) {
      return InvalidArgumentError(std::string(where) + ": invalid UTF-8 at byte offset " +
                                  std::to_string(i) + " (byte " +
                                  Hex(static_cast<unsigned char>(text[i])) + ")");
    }
    i += len;
  }
  return Status::Ok();
}

Status TokenizeDocument(std::string_view text, std::string_view where, std::vector<uint16_t>& out) {
  // Validate first, so a refused document leaves `out` as it was.
  UCP_RETURN_IF_ERROR(ValidateDocumentText(text, where));
  // Grow geometrically: an exact reserve per document would copy the whole corpus every call.
  const size_t needed = out.size() + text.size() + 1;
  if (out.capacity() < needed) out.reserve(std::max(needed, 2 * out.capacity()));
  for (char c : text) out.push_back(static_cast<unsigned char>(c));
  out.push_back(kEndOfText);
  return Status::Ok();
}

std::string Detokenize(std::span<const uint16_t> tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (uint16_t t : tokens) {
    if (t == kEndOfText) {
      out += "\n<|end|>\n";
    } else if (t < 256) {
      out.push_back(static_cast<char>(static_cast<unsigned char>(t)));
    } else {
      out += "<|" + std::to_string(t) + "|>";
    }
  }
  return out;
}

Status TokenizeTextFile(const std::filesystem::path& path, std::vector<uint16_t>& out) {
  UCP_ASSIGN_OR_RETURN(std::string text, io::ReadFileToString(path, int64_t{2} << 30));
  return TokenizeDocument(text, path.string(), out);
}

}  // namespace ucp::offload
