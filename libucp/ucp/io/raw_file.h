// RawFile: positional reads and writes (pread / pwrite) on one open file. This is the data path
// of ucp's HDF5 formats: a file's metadata (groups, datasets, attributes) is written and parsed
// through io/hdf5, which also reports where each contiguous dataset's bytes start; the bytes
// themselves then move straight between the file and the caller's buffer, from many threads at
// once, with no HDF5 call, no global lock and no intermediate copy (docs/adr/0004).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "ucp/base/result.h"
#include "ucp/base/status.h"

namespace ucp::io {

/// What identifies a file's content cheaply: device, inode, size and modification time (ns).
/// Seen at open and again at commit, it tells whether a source changed while it was read
/// (issue 16 #8): a replaced file (new inode), one written in place (mtime) or truncated (size).
struct FileIdentity {
  uint64_t device = 0;
  uint64_t inode = 0;
  int64_t size_bytes = 0;
  int64_t mtime_ns = 0;
  friend bool operator==(const FileIdentity&, const FileIdentity&) = default;
};

/// The identity of the file at `path` now (following symlinks).
/// Errors: kNotFound (no such file), kIoError.
Result<FileIdentity> StatFileIdentity(const std::filesystem::path& path);

/// The identity of the open file `fd` (fstat: the file actually opened, even if its path has
/// since been replaced). Errors: kIoError.
Result<FileIdentity> FdFileIdentity(int fd);

/// Checks that `path` still has identity `seen`.
/// Errors: kDataLoss naming the file and what changed (replaced, size, mtime) or that it was
/// removed: the output would no longer match the source's checksums; kIoError (stat failed).
Status CheckFileUnchanged(const std::filesystem::path& path, const FileIdentity& seen);

/// Bytes read from checkpoint files by this process so far (RawFile::ReadAt and the torch
/// reader's file reads), for the instrumentation that shows a verified conversion reads each
/// source byte once (issue 14). Relaxed; a running total.
int64_t SourceBytesRead();
/// Adds `bytes` to SourceBytesRead (the readers that pread files themselves).
void CountSourceBytesRead(int64_t bytes);

class RawFile {
 public:
  /// Opens an existing file for reading.
  /// Errors: kNotFound (no such file), kIoError.
  static Result<RawFile> OpenForRead(const std::filesystem::path& path);
  /// Opens an existing file for writing in place (it is neither created nor truncated).
  /// Errors: kNotFound, kIoError.
  static Result<RawFile> OpenForWrite(const std::filesystem::path& path);

  RawFile(RawFile&& o) noexcept;
  RawFile& operator=(RawFile&& o) noexcept;
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;
  ~RawFile();

  const std::filesystem::path& path() const { return path_; }
  /// The file's size when it was opened, in bytes.
  int64_t size_bytes() const { return size_bytes_; }
  /// The file's identity when it was opened.
  const FileIdentity& identity() const { return identity_; }

  /// Reads exactly out.size() bytes at `offset`. Thread-safe.
  /// Errors: kDataLoss when the range reaches past the end of the file (a truncated file),
  /// naming the file and the byte range; kIoError.
  Status ReadAt(int64_t offset, std::span<std::byte> out) const;
  /// Writes all of `data` at `offset`. Thread-safe for disjoint ranges.
  /// Errors: kIoError naming the file and the byte range.
  Status WriteAt(int64_t offset, std::span<const std::byte> data);
  /// fsync. Errors: kIoError.
  Status Sync();
  /// Starts writing the file's dirty pages to disk without waiting (sync_file_range), so that a
  /// later fsync of many finished files finds little left to do. Errors: kIoError.
  Status StartWriteback();
  /// Closes now, reporting what close(2) reports. Later calls fail.
  /// Errors: kIoError, kFailedPrecondition (already closed).
  Status Close();

 private:
  RawFile(int fd, std::filesystem::path path, int64_t size_bytes)
      : fd_(fd), path_(std::move(path)), size_bytes_(size_bytes) {}
  int fd_ = -1;
  std::filesystem::path path_;
  int64_t size_bytes_ = 0;
  FileIdentity identity_;
};

/// How many files a RawFileCache keeps open by default: 256, or fewer when the soft open-file
/// limit leaves less (a quarter of what is left beyond the descriptors held now, at least 4),
/// so that reading a checkpoint of thousands of files works under a low `ulimit -n`.
size_t DefaultFileCacheCapacity();

/// Files open for reading, shared by the threads of a reader, at most `capacity` at once (the
/// least recently used is closed first; a reader still holding it keeps it open until done).
/// Keeps per-read opens out of hot loops without running into the descriptor limit on
/// checkpoints of thousands of files. Thread-safe.
class RawFileCache {
 public:
  explicit RawFileCache(size_t capacity = DefaultFileCacheCapacity()) : capacity_(capacity) {}
  /// Errors: as RawFile::OpenForRead; kDataLoss when the file was opened before (and closed
  /// since) and is no longer the same file (CheckFileUnchanged).
  Result<std::shared_ptr<const RawFile>> Get(const std::filesystem::path& path);

  /// Records the identity of `path` now, as the first open would (for files read through
  /// another library first, e.g. HDF5 metadata), or checks it against the one recorded.
  /// Errors: as StatFileIdentity; kDataLoss as Get.
  Status Note(const std::filesystem::path& path);

  /// Checks that every file this cache has opened or noted is still the file it was then (same
  /// device, inode, size and mtime), in path order. A reader's owner calls it before committing
  /// what it wrote from them.
  /// Errors: kDataLoss naming the first file that changed or was removed; kIoError.
  Status CheckUnchanged() const;

 private:
  // Records `id` for `key`, or checks it against the identity recorded before.
  Status Remember(const std::string& key, const FileIdentity& id);

  using Entry = std::pair<std::string, std::shared_ptr<const RawFile>>;
  size_t capacity_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, FileIdentity> seen_;  // never evicted
  std::list<Entry> lru_;  // most recent first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
};

/// Makes sure this process may hold `needed` more open files than it holds now: raises the soft
/// RLIMIT_NOFILE (up to the hard limit) when it is too low. Writers that keep every output file
/// of a checkpoint open while slices stream in (the DeepSpeed writer: one optimizer file per
/// data-parallel rank per model rank) call it before opening them.
/// Errors: kResourceExhausted naming both numbers when even the hard limit is too low ("raise
/// ulimit -n"); kIoError when the limit cannot be read or set.
Status EnsureOpenFileLimit(int64_t needed);

}  // namespace ucp::io
