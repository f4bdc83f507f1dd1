// Atomic file and folder writes on POSIX: mkstemp/mkdtemp, fsync, renameat2 and directory fsync.
#include "ucp/io/atomic_file.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <mutex>
#include <system_error>
#include <vector>

#include "ucp/base/status_macros.h"
#include "ucp/io/interrupt.h"

namespace ucp::io {
namespace fs = std::filesystem;

namespace {

// Closes a descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now, reporting the error that close may carry for buffered writes.
  Status Close(const std::string& what) {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoError("close " + what, errno);
    return Status::Ok();
  }

 private:
  int fd_;
};

Status WriteAll(int fd, std::span<const std::byte> bytes, const std::string& what) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write " + what, errno);
    }
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

fs::path ParentOf(const fs::path& path) {
  fs::path parent = WithoutTrailingSlash(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// Gives a file made by mkstemp (0600) or a folder made by mkdtemp (0700) the mode open(2) or
// mkdir(2) would have given it: 0666 or 0777 less the umask, so a checkpoint on a shared cluster
// is as readable as any other file its user writes.
Status ChmodToUmask(int fd, const std::string& path, bool is_dir) {
  const mode_t mode = (is_dir ? 0777 : 0666) & ~ProcessUmask();
  if (::fchmod(fd, mode) != 0) return ErrnoError("chmod " + path, errno);
  return Status::Ok();
}

}  // namespace

mode_t ProcessUmask() {
  // umask(2) can only be read by setting it, which races with other threads creating files;
  // /proc/self/status reports it read-only (Linux >= 4.7).
  if (FILE* f = std::fopen("/proc/self/status", "re")) {
    char line[256];
    unsigned value = 0;
    bool found = false;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      if (std::sscanf(line, "Umask: %o", &value) == 1) {
        found = true;
        break;
      }
    }
    std::fclose(f);
    if (found) return static_cast<mode_t>(value & 0777);
  }
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  const mode_t old = ::umask(022);
  ::umask(old);
  return old;
}

fs::path WithoutTrailingSlash(const fs::path& path) {
  std::string s = path.string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return fs::path(s);
}

bool IsTempName(std::string_view file_name) {
  return file_name.find(kTempMarker) != std::string_view::npos;
}

Status WriteFileAtomic(const fs::path& path, std::span<const std::byte> bytes) {
  const fs::path dir = ParentOf(path);
  std::string templ =
      (dir / ("." + path.filename().string() + std::string(kTempMarker) + "XXXXXX")).string();
  // Removed on SIGINT/SIGTERM until it is renamed into place (interrupt.h).
  int raw = -1;
  const int err = CreateRegisteredTempPath(templ, [&raw](std::string& t) {
    raw = ::mkstemp(t.data());
    return raw < 0 ? errno : 0;
  });
  if (err != 0) return ErrnoError("create a temporary file for " + path.string(), err);
  Fd fd(raw);
  Status st = ChmodToUmask(fd.get(), templ, /*is_dir=*/false);
  if (st.ok()) st = WriteAll(fd.get(), bytes, templ);
  if (st.ok() && ::fsync(fd.get()) != 0) st = ErrnoError("fsync " + templ, errno);
  if (st.ok()) st = fd.Close(templ);
  if (st.ok() && ::rename(templ.c_str(), path.c_str()) != 0) {
    st = ErrnoError("rename " + templ + " to " + path.string(), errno);
  }
  if (!st.ok()) ::unlink(templ.c_str());
  UnregisterTempPath(templ);
  if (!st.ok()) return st;
  return FsyncPath(dir);
}

Status WriteFileAtomic(const fs::path& path, std::string_view text) {
  return WriteFileAtomic(path, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

Result<std::string> ReadFileToString(const fs::path& path, int64_t max_bytes) {
  // O_NONBLOCK: a FIFO in place of the file must not block the open; it is refused below.
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (raw < 0) {
    if (errno == ENOENT) return NotFoundError("file " + path.string() + " does not exist");
    return ErrnoError("open " + path.string(), errno);
  }
  Fd fd(raw);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError("stat " + path.string(), errno);
  if (!S_ISREG(st.st_mode)) return IoError(path.string() + " is not a regular file");
  if (::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK) != 0) {
    return ErrnoError("fcntl " + path.string(), errno);
  }
  if (st.st_size > max_bytes) {
    return ResourceExhaustedError("file " + path.string() + " is " + std::to_string(st.st_size) +
                                  " bytes, more than the limit of " + std::to_string(max_bytes) +
                                  " bytes");
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read " + path.string(), errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

Status FsyncPath(const fs::path& path) {
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) {
    if (errno == ENOENT)
      return NotFoundError("cannot fsync " + path.string() + ": it does not exist");
    return ErrnoError("open " + path.string() + " for fsync", errno);
  }
  Fd fd(raw);
  if (::fsync(fd.get()) != 0) return ErrnoError("fsync " + path.string(), errno);
  return Status::Ok();
}

Status FsyncTree(const fs::path& root) {
  std::error_code ec;
  std::vector<fs::path> dirs;
  for (auto it = fs::recursive_directory_iterator(root, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_directory(ec)) {
      dirs.push_back(it->path());
    } else if (it->is_regular_file(ec)) {
      UCP_RETURN_IF_ERROR(FsyncPath(it->path()));
    }
  }
  if (ec) return ErrnoError("list " + root.string(), ec.value());
  // Children before parents, so each directory entry is durable once its parent is.
  for (auto it = dirs.rbegin(); it != dirs.rend(); ++it) UCP_RETURN_IF_ERROR(FsyncPath(*it));
  return FsyncPath(root);
}

Result<fs::path> MakeTempSiblingDir(const fs::path& dst_in) {
  const fs::path dst = WithoutTrailingSlash(dst_in);
  const fs::path parent = ParentOf(dst);
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) {
    return NotFoundError("parent folder " + parent.string() + " of " + dst.string() +
                         " does not exist");
  }
  std::string templ = dst.string() + std::string(kTempMarker) + "XXXXXX";
  // Removed on SIGINT/SIGTERM until it is committed or removed (interrupt.h).
  const int err = CreateRegisteredTempPath(
      templ, [](std::string& t) { return ::mkdtemp(t.data()) == nullptr ? errno : 0; });
  if (err != 0) return ErrnoError("create a temporary folder next to " + dst.string(), err);
  const int raw = ::open(templ.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  Status st = raw < 0 ? ErrnoError("open " + templ, errno) : Status::Ok();
  if (raw >= 0) {
    Fd fd(raw);
    st = ChmodToUmask(fd.get(), templ, /*is_dir=*/true);
  }
  if (!st.ok()) {
    ::rmdir(templ.c_str());
    UnregisterTempPath(templ);
    return st;
  }
  return fs::path(templ);
}

Status RenameNoReplace(const fs::path& from_in, const fs::path& to_in) {
  const fs::path from = WithoutTrailingSlash(from_in);
  const fs::path to = WithoutTrailingSlash(to_in);
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) != 0) {
    int err = errno;
    if (err == EEXIST)
      return AlreadyExistsError(to.string() + " already exists; ucp never overwrites");
    if (err != EINVAL && err != ENOSYS) {
      return ErrnoError("rename " + from.string() + " to " + to.string(), err);
    }
    // Filesystems without RENAME_NOREPLACE: check, then rename (a small race, documented).
    std::error_code ec;
    if (fs::exists(fs::symlink_status(to, ec))) {
      return AlreadyExistsError(to.string() + " already exists; ucp never overwrites");
    }
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoError("rename " + from.string() + " to " + to.string(), errno);
    }
  }
  UnregisterTempPath(from);
  return FsyncPath(ParentOf(to));
}

void RemoveTreeBestEffort(const fs::path& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  UnregisterTempPath(path);
}

}  // namespace ucp::io
