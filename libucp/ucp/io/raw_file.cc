// RawFile over open(2), pread(2), pwrite(2), fsync(2).
#include "ucp/io/raw_file.h"

#include "ucp/base/status_macros.h"

#include <dirent.h>
#include <fcntl.h>

#include <cstring>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <vector>
#include <string>
#include <utility>

namespace ucp::io {
namespace fs = std::filesystem;

namespace {

std::string RangeText(int64_t offset, size_t n) {
  return "bytes [" + std::to_string(offset) + ", " +
         std::to_string(offset + static_cast<int64_t>(n)) + ")";
}

FileIdentity IdentityOf(const struct stat& st) {
  FileIdentity id;
  id.device = static_cast<uint64_t>(st.st_dev);
  id.inode = static_cast<uint64_t>(st.st_ino);
  id.size_bytes = static_cast<int64_t>(st.st_size);
  id.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return id;
}

Result<RawFile> OpenWith(const fs::path& path, int flags, const char* what,
                         RawFile (*make)(int, fs::path, const FileIdentity&)) {
  // O_NONBLOCK: opening a FIFO (or a device) put where a checkpoint file belongs must not wait
  // forever for a writer; anything but a regular file is refused after fstat.
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return NotFoundError("file " + path.string() + " does not exist");
    if (e == ENXIO) return IoError(path.string() + " is not a regular file (a FIFO or socket)");
    if (e == EMFILE || e == ENFILE || e == ENOMEM) {
      return ResourceExhaustedError(std::string("open ") + what + " " + path.string() + ": " +
                                    std::strerror(e));
    }
    return ErrnoError(std::string("open ") + what + " " + path.string(), e);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoError("fstat " + path.string(), e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return IoError(path.string() + " is not a regular file");
  }
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    const int e = errno;
    ::close(fd);
    return ErrnoError("fcntl " + path.string(), e);
  }
  return make(fd, path, IdentityOf(st));
}

}  // namespace

Result<FileIdentity> StatFileIdentity(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == ENOENT) return NotFoundError("file " + path.string() + " does not exist");
    return ErrnoError("stat " + path.string(), e);
  }
  return IdentityOf(st);
}

Result<FileIdentity> FdFileIdentity(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("fstat", errno);
  return IdentityOf(st);
}

Status CheckFileUnchanged(const fs::path& path, const FileIdentity& seen) {
  const std::string lead = "source file " + path.string() + " changed while ucp was reading it (";
  const std::string tail = "); the output would not match the source it was checked against";
  Result<FileIdentity> now = StatFileIdentity(path);
  if (!now.ok()) {
    if (now.status().code() == StatusCode::kNotFound) return DataLossError(lead + "removed" + tail);
    return now.status();
  }
  if (now->device != seen.device || now->inode != seen.inode) {
    return DataLossError(lead + "replaced by another file" + tail);
  }
  if (now->size_bytes != seen.size_bytes) {
    return DataLossError(lead + "size " + std::to_string(seen.size_bytes) + " -> " +
                         std::to_string(now->size_bytes) + " bytes" + tail);
  }
  if (now->mtime_ns != seen.mtime_ns) {
    return DataLossError(lead + "modified: mtime moved by " +
                         std::to_string(now->mtime_ns - seen.mtime_ns) + " ns" + tail);
  }
  return Status::Ok();
}

Result<RawFile> RawFile::OpenForRead(const fs::path& path) {
  return OpenWith(path, O_RDONLY, "for reading", [](int fd, fs::path p, const FileIdentity& id) {
    RawFile f(fd, std::move(p), id.size_bytes);
    f.identity_ = id;
    return f;
  });
}

Result<RawFile> RawFile::OpenForWrite(const fs::path& path) {
  return OpenWith(path, O_WRONLY, "for writing", [](int fd, fs::path p, const FileIdentity& id) {
    RawFile f(fd, std::move(p), id.size_bytes);
    f.identity_ = id;
    return f;
  });
}

RawFile::RawFile(RawFile&& o) noexcept
    : fd_(o.fd_), path_(std::move(o.path_)), size_bytes_(o.size_bytes_), identity_(o.identity_) {
  o.fd_ = -1;
}

RawFile& RawFile::operator=(RawFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    size_bytes_ = o.size_bytes_;
    identity_ = o.identity_;
    o.fd_ = -1;
  }
  return *this;
}

RawFile::~RawFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status RawFile::ReadAt(int64_t offset, std::span<std::byte> out) const {
  if (fd_ < 0) return FailedPreconditionError("file " + path_.string() + " is closed");
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done,
                              static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read " + RangeText(offset, out.size()) + " of " + path_.string(), errno);
    }
    if (n == 0) {
      return DataLossError("file " + path_.string() + " ends at byte " +
                           std::to_string(offset + static_cast<int64_t>(done)) + " inside " +
                           RangeText(offset, out.size()) + ": truncated");
    }
    done += static_cast<size_t>(n);
  }
  CountSourceBytesRead(static_cast<int64_t>(out.size()));
  return Status::Ok();
}

namespace {
std::atomic<int64_t> g_source_bytes_read{0};
}  // namespace

int64_t SourceBytesRead() { return g_source_bytes_read.load(std::memory_order_relaxed); }
void CountSourceBytesRead(int64_t bytes) {
  g_source_bytes_read.fetch_add(bytes, std::memory_order_relaxed);
}

Status RawFile::WriteAt(int64_t offset, std::span<const std::byte> data) {
  if (fd_ < 0) return FailedPreconditionError("file " + path_.string() + " is closed");
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::pwrite(fd_, data.data() + done, data.size() - done,
                               static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write " + RangeText(offset, data.size()) + " of " + path_.string(), errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status RawFile::Sync() {
  if (fd_ < 0) return FailedPreconditionError("file " + path_.string() + " is closed");
  if (::fsync(fd_) != 0) return ErrnoError("fsync " + path_.string(), errno);
  return Status::Ok();
}

Status RawFile::StartWriteback() {
  if (fd_ < 0) return FailedPreconditionError("file " + path_.string() + " is closed");
  if (::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE) != 0) {
    return ErrnoError("sync_file_range " + path_.string(), errno);
  }
  return Status::Ok();
}

Status RawFile::Close() {
  if (fd_ < 0) return FailedPreconditionError("file " + path_.string() + " is already closed");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return ErrnoError("close " + path_.string(), errno);
  return Status::Ok();
}

Status RawFileCache::Remember(const std::string& key, const FileIdentity& id) {
  auto [it, inserted] = seen_.emplace(key, id);
  if (inserted || it->second == id) return Status::Ok();
  // Reopened after eviction, or noted earlier: report the change against the first sighting.
  Status changed = CheckFileUnchanged(key, it->second);
  if (!changed.ok()) return changed;
  return DataLossError("source file " + key + " changed while ucp was reading it");
}

Status RawFileCache::Note(const fs::path& path) {
  UCP_ASSIGN_OR_RETURN(FileIdentity id, StatFileIdentity(path));
  std::lock_guard<std::mutex> lock(mu_);
  return Remember(path.string(), id);
}

Status RawFileCache::CheckUnchanged() const {
  std::vector<std::pair<std::string, FileIdentity>> seen;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seen.assign(seen_.begin(), seen_.end());
  }
  std::sort(seen.begin(), seen.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [path, id] : seen) UCP_RETURN_IF_ERROR(CheckFileUnchanged(path, id));
  return Status::Ok();
}

Result<std::shared_ptr<const RawFile>> RawFileCache::Get(const fs::path& path) {
  const std::string key = path.string();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
  }
  // Opened outside the lock; two threads racing for the same file both open it, one is kept.
  Result<RawFile> opened = RawFile::OpenForRead(path);
  if (!opened.ok()) return opened.status();
  auto file = std::make_shared<const RawFile>(std::move(*opened));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(key);
  if (it != index_.end()) return it->second->second;
  UCP_RETURN_IF_ERROR(Remember(key, file->identity()));
  lru_.emplace_front(key, file);
  index_[key] = lru_.begin();
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return file;
}

namespace {

// The descriptors this process holds now (/proc/self/fd, less the one that lists it).
int64_t OpenFileCount() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 64;  // no /proc: a margin for what a process usually holds
  int64_t n = 0;
  while (::readdir(d) != nullptr) ++n;
  ::closedir(d);
  return n - 3;  // ".", ".." and the directory's own descriptor
}

}  // namespace

size_t DefaultFileCacheCapacity() {
  constexpr int64_t kMax = 256, kMin = 4;
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return kMax;
  const int64_t spare = static_cast<int64_t>(lim.rlim_cur) - OpenFileCount();
  return static_cast<size_t>(std::clamp<int64_t>(spare / 4, kMin, kMax));
}

Status EnsureOpenFileLimit(int64_t needed) {
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return ErrnoError("cannot read the open-file limit", errno);
  }
  // A margin for what the executor and the libraries open meanwhile; readers' caches size
  // themselves from the limit (DefaultFileCacheCapacity), so a small margin is enough.
  const int64_t want = OpenFileCount() + needed + 16;
  if (lim.rlim_cur != RLIM_INFINITY && static_cast<int64_t>(lim.rlim_cur) >= want) {
    return Status::Ok();
  }
  if (lim.rlim_cur == RLIM_INFINITY) return Status::Ok();
  if (lim.rlim_max != RLIM_INFINITY && static_cast<int64_t>(lim.rlim_max) < want) {
    return ResourceExhaustedError("writing needs " + std::to_string(want) +
                                  " open files but the hard limit is " +
                                  std::to_string(lim.rlim_max) + "; raise ulimit -n");
  }
  lim.rlim_cur = static_cast<rlim_t>(want);
  if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    return ErrnoError("cannot raise the open-file limit to " + std::to_string(want), errno);
  }
  return Status::Ok();
}

}  // namespace ucp::io
