// Atomic, durable file and folder operations: what makes a finished checkpoint either complete
// or invisible. A file is written under a temporary sibling name, fsynced, renamed into place and
// its directory fsynced; a folder is built under a `.tmp-` sibling and renamed the same way.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::io {

/// The marker in the names of unfinished outputs: `DST.tmp-XXXXXX`, `.name.tmp-XXXXXX`.
inline constexpr std::string_view kTempMarker = ".tmp-";

/// `path` without trailing slashes ("/" itself is kept): `out/` names the folder `out`, whose
/// parent is `.`. Writers normalise their destination with it.
std::filesystem::path WithoutTrailingSlash(const std::filesystem::path& path);

/// True when a file or folder name carries kTempMarker, i.e. it is an unfinished write.
bool IsTempName(std::string_view file_name);

/// Writes `bytes` to `path` atomically and durably: a temporary file in the same directory,
/// fsync, rename over `path`, fsync of the directory. Readers see the old content or the new,
/// never a mix. The file gets mode 0666 less the umask. The directory must exist.
/// Errors: kIoError (with errno text) from open, write, fsync or rename.
Status WriteFileAtomic(const std::filesystem::path& path, std::span<const std::byte> bytes);
Status WriteFileAtomic(const std::filesystem::path& path, std::string_view text);

/// Reads a whole file, refusing files larger than `max_bytes`.
/// Errors: kNotFound (missing), kResourceExhausted (larger than max_bytes), kIoError.
Result<std::string> ReadFileToString(const std::filesystem::path& path, int64_t max_bytes);

/// fsyncs one file or directory.
/// Errors: kNotFound, kIoError.
Status FsyncPath(const std::filesystem::path& path);

/// fsyncs every regular file and directory under `root`, and `root` itself (files first).
/// Errors: kNotFound, kIoError.
Status FsyncTree(const std::filesystem::path& root);

/// Creates a fresh empty directory `<dst>.tmp-XXXXXX` next to `dst` (same filesystem, so it can
/// later be renamed onto `dst`), with mode 0777 less the umask. The parent of `dst` must exist.
/// Trailing slashes are ignored: `out/` names the folder `out`.
/// Errors: kNotFound (no parent), kIoError.
Result<std::filesystem::path> MakeTempSiblingDir(const std::filesystem::path& dst);

/// Renames `from` to `to`, failing when `to` exists (never replaces), then fsyncs the parent of
/// `to`. Trailing slashes are ignored. Uses renameat2(RENAME_NOREPLACE); where the filesystem lacks it, checks then renames.
/// Errors: kAlreadyExists (to exists), kIoError.
Status RenameNoReplace(const std::filesystem::path& from, const std::filesystem::path& to);

/// The process's umask, read without changing it (from /proc/self/status where available).
mode_t ProcessUmask();

/// Removes a tree, ignoring errors: the cleanup after an earlier failure.
void RemoveTreeBestEffort(const std::filesystem::path& path);

}  // namespace ucp::io
