// Token files in llm.c's format, so users can bring data tokenized elsewhere: a header of 256
// little-endian int32 (header[0] = magic 20240520, header[1] = version 1, header[2] = number of
// tokens), then that many uint16 tokens. Read memory-mapped; written atomically. This is what
// llm.c's dev/data/data_common.py write_datafile writes for "gpt-2" and llmc/dataloader.h reads;
// header[3..255] are written as zeros and, as in llm.c, not checked on read. llm.c's "llama-3"
// variant (magic 20240801, uint32 tokens) is recognized and refused as unimplemented.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>

#include "ucp/base/result.h"

namespace ucp::offload {

inline constexpr int32_t kTokenFileMagic = 20240520;
inline constexpr int32_t kTokenFileVersion = 1;
inline constexpr int64_t kTokenFileHeaderInts = 256;

/// A read-only, memory-mapped token file. Movable; the mapping lives as long as the object, so
/// tokens() must not outlive it.
class TokenFile {
 public:
  /// Opens and validates `path`. Never blocks: a FIFO or device is refused after an O_NONBLOCK
  /// open and fstat, before any read.
  /// Errors: kNotFound (no file), kDataLoss naming the file and field, one message per rule
  /// ("short header", "header[0] (magic)", "header[1] (version)", "header[2] (token count) is
  /// ..., negative", "odd size", "truncated", "trailing bytes"), kUnimplemented (llm.c's llama-3
  /// magic), kFailedPrecondition (a directory, FIFO, device or socket), kIoError.
  static Result<TokenFile> Open(const std::filesystem::path& path);
  TokenFile(TokenFile&&) noexcept;
  TokenFile& operator=(TokenFile&&) noexcept;
  ~TokenFile();

  std::span<const uint16_t> tokens() const;   ///< header[2] tokens, in the mapping
  const std::filesystem::path& path() const;  ///< as given to Open

 private:
  struct Impl;
  explicit TokenFile(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Writes `tokens` to `path` (temp name in the same folder, fsync, rename, fsync of the folder),
/// never replacing a file that exists, even one created meanwhile (the final rename is
/// RENAME_NOREPLACE). Deterministic: the same tokens give the same bytes. Builds the file in
/// memory first (1 KiB + 2 bytes per token).
/// Errors: kAlreadyExists (path exists), kInvalidArgument (more than INT32_MAX tokens), kIoError.
Status WriteTokenFile(const std::filesystem::path& path, std::span<const uint16_t> tokens);

}  // namespace ucp::offload
