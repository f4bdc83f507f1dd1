// The built-in tokenizer: bytes. Token t < 256 is the byte t of UTF-8 text; token 0 (NUL, which
// text never holds) ends a document. Valid UTF-8 never has bytes 0xF5..0xFF, so UTF-8 text needs
// tokens < 245 and fits every preset's vocabulary (the tiny ones have 250).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ucp/base/result.h"

namespace ucp::offload {

inline constexpr uint16_t kEndOfText = 0;

/// Appends the bytes of `text` as tokens, then kEndOfText. On error `out` is left unchanged.
/// Errors: kInvalidArgument naming the byte offset of a NUL or invalid UTF-8 (`where` names the
/// document in the message).
Status TokenizeDocument(std::string_view text, std::string_view where, std::vector<uint16_t>& out);

/// Checks that `text` can be a document: valid UTF-8 (RFC 3629: no overlong forms, surrogates or
/// code points above U+10FFFF) without NUL. TokenizeDocument runs the same check; this one lets a
/// caller vet a whole file first, so offsets are file offsets.
/// Errors: kInvalidArgument "<where>: invalid UTF-8 at byte offset N (byte 0xFF)" or
/// "<where>: NUL byte at byte offset N".
Status ValidateDocumentText(std::string_view text, std::string_view where);

/// Reads a whole UTF-8 text file (at most 2 GiB) and appends its bytes as tokens, as one
/// document (TokenizeDocument). What `ucp-train --tokenize` and `--data TEXT` use.
/// Errors: kNotFound, kResourceExhausted (over 2 GiB), kIoError; as TokenizeDocument, naming the
/// file.
Status TokenizeTextFile(const std::filesystem::path& path, std::vector<uint16_t>& out);

/// The bytes of tokens (kEndOfText shown as "\n<|end|>\n"); tokens >= 256 as "<|N|>".
std::string Detokenize(std::span<const uint16_t> tokens);

}  // namespace ucp::offload
