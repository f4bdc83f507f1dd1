// SafetensorsWriter over mkstemp + ftruncate + pwrite + fsync + rename, with a record of the byte
// ranges written so that a forgotten range fails Commit instead of shipping as zeros.
#include "ucp/io/safetensors/safetensors_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <iterator>
#include <mutex>
#include <utility>

#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"

namespace ucp::safetensors {

namespace fs = std::filesystem;

struct SafetensorsWriter::Impl {
  fs::path path;
  fs::path temp;
  SafetensorsWriteOptions options;
  SafetensorsLayout layout;
  int fd = -1;
  bool committed = false;

  std::mutex mu;
  // Per tensor: the written ranges within it, begin → end, disjoint and merged when adjacent.
  std::vector<std::map<int64_t, int64_t>> written;

  ~Impl() {
    if (fd >= 0) ::close(fd);
    if (!committed && !temp.empty()) ::unlink(temp.c_str());
  }

  Status PWriteAll(int64_t offset, std::span<const std::byte> bytes) const {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done,
                                 static_cast<off_t>(offset + static_cast<int64_t>(done)));
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoError("pwrite of " + std::to_string(bytes.size() - done) + " bytes at offset " +
                              std::to_string(offset + done) + " of " + temp.string(),
                          errno);
      }
      done += static_cast<size_t>(n);
    }
    return Status::Ok();
  }
};

SafetensorsWriter::SafetensorsWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter& SafetensorsWriter::operator=(SafetensorsWriter&&) noexcept = default;
SafetensorsWriter::~SafetensorsWriter() = default;

Result<SafetensorsWriter> SafetensorsWriter::Create(const fs::path& path,
                                                    std::span<const SafetensorsTensorSpec> tensors,
                                                    SafetensorsWriteOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  UCP_ASSIGN_OR_RETURN(impl->layout, LayOut(tensors, options.metadata),
                       "while laying out safetensors file " + path.string());
  impl->options = std::move(options);
  impl->written.resize(impl->layout.entries.size());

  std::error_code ec;
  const fs::path parent = path.has_parent_path() ? path.parent_path() : fs::path(".");
  if (!fs::is_directory(parent, ec)) {
    return NotFoundError("folder " + parent.string() + " of safetensors file " + path.string() +
                         " does not exist");
  }
  // Checked again, atomically, by the rename; failing here saves writing a whole file first.
  if (!impl->options.overwrite && fs::exists(fs::symlink_status(path, ec))) {
    return AlreadyExistsError(path.string() + " already exists; ucp never overwrites");
  }
  std::string templ = path.string() + std::string(io::kTempMarker) + "XXXXXX";
  const int fd = ::mkostemp(templ.data(), O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot create a temporary file for " + path.string(), errno);
  impl->fd = fd;
  impl->temp = templ;
  // mkstemp makes the file 0600; a model file should be as readable as one save_file makes.
  if (::fchmod(fd, 0644) != 0) return ErrnoError("cannot chmod " + templ, errno);
  const int64_t total =
      static_cast<int64_t>(impl->layout.prefix.size()) + impl->layout.data_size_bytes;
  // The full size up front, so that ranges can land in any order; holes are caught by Commit.
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0) {
    return ErrnoError("cannot size " + templ + " to " + std::to_string(total) + " bytes", errno);
  }
  UCP_RETURN_IF_ERROR(
      impl->PWriteAll(0, std::as_bytes(std::span<const char>(impl->layout.prefix.data(),
                                                             impl->layout.prefix.size()))));
  return SafetensorsWriter(std::move(impl));
}

const std::vector<SafetensorsEntry>& SafetensorsWriter::entries() const {
  return impl_->layout.entries;
}

Result<size_t> SafetensorsWriter::IndexOf(std::string_view name) const {
  const auto& all = impl_->layout.entries;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].name == name) return i;
  }
  return NotFoundError("tensor '" + std::string(name) + "' is not in the layout of " +
                       impl_->path.string());
}

Status SafetensorsWriter::WriteRange(size_t index, int64_t byte_begin,
                                     std::span<const std::byte> bytes) {
  Impl& s = *impl_;
  if (index >= s.layout.entries.size()) {
    return OutOfRangeError("tensor index " + std::to_string(index) + " of " + s.path.string() +
                           " is past its " + std::to_string(s.layout.entries.size()) + " tensors");
  }
  const SafetensorsEntry& e = s.layout.entries[index];
  const auto n = static_cast<int64_t>(bytes.size());
  if (byte_begin < 0 || byte_begin > e.num_bytes() || n > e.num_bytes() - byte_begin) {
    return OutOfRangeError("bytes [" + std::to_string(byte_begin) + ", +" + std::to_string(n) +
                           ") are not within tensor '" + e.name + "' (" +
                           std::to_string(e.num_bytes()) + " bytes) of " + s.path.string());
  }
  if (n == 0) return Status::Ok();
  const int64_t byte_end = byte_begin + n;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.committed) {
      return FailedPreconditionError("safetensors file " + s.path.string() + " is committed");
    }
    auto& ranges = s.written[index];
    // Ranges are disjoint, so the last one starting before byte_end reaches furthest right.
    auto last = ranges.lower_bound(byte_end);
    if (last != ranges.begin() && std::prev(last)->second > byte_begin) {
      const auto& [b, end] = *std::prev(last);
      return InvalidArgumentError("bytes [" + std::to_string(byte_begin) + ", " +
                                  std::to_string(byte_end) + ") of tensor '" + e.name + "' of " +
                                  s.path.string() + " overlap bytes [" + std::to_string(b) + ", " +
                                  std::to_string(end) + ") written before");
    }
    // Recorded before the pwrite, outside the lock, so that a concurrent overlapping call is
    // refused. Adjacent ranges merge, keeping the map small for tensors written in pieces.
    int64_t begin = byte_begin, end = byte_end;
    auto before = ranges.lower_bound(byte_begin);
    if (before != ranges.begin() && std::prev(before)->second == byte_begin) {
      begin = std::prev(before)->first;
      ranges.erase(std::prev(before));
    }
    auto after = ranges.find(byte_end);
    if (after != ranges.end()) {
      end = after->second;
      ranges.erase(after);
    }
    ranges.emplace(begin, end);
  }
  return s.PWriteAll(static_cast<int64_t>(s.layout.prefix.size()) + e.data_begin + byte_begin,
                     bytes);
}

Status SafetensorsWriter::WriteTensor(std::string_view name, const ConstTensorView& view) {
  UCP_ASSIGN_OR_RETURN(const size_t index, IndexOf(name));
  const SafetensorsEntry& e = impl_->layout.entries[index];
  if (view.dtype != e.dtype || view.shape != e.shape) {
    return InvalidArgumentError("tensor '" + e.name + "' of " + impl_->path.string() +
                                " was laid out as " + std::string(DTypeName(e.dtype)) +
                                " but is written as " + std::string(DTypeName(view.dtype)) +
                                " or with another shape");
  }
  UCP_RETURN_IF_ERROR(ValidateView(view, "tensor '" + e.name + "'"));
  return WriteRange(index, 0, view.bytes);
}

Status SafetensorsWriter::Commit() {
  Impl& s = *impl_;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.committed) {
      return FailedPreconditionError("safetensors file " + s.path.string() +
                                     " is already committed");
    }
    for (size_t i = 0; i < s.layout.entries.size(); ++i) {
      const SafetensorsEntry& e = s.layout.entries[i];
      if (e.num_bytes() == 0) continue;
      const auto& ranges = s.written[i];
      const bool whole = ranges.size() == 1 && ranges.begin()->first == 0 &&
                         ranges.begin()->second == e.num_bytes();
      if (!whole) {
        int64_t gap_begin = 0;
        for (const auto& [b, end] : ranges) {
          if (b > gap_begin) break;
          gap_begin = end;
        }
        return FailedPreconditionError("tensor '" + e.name + "' of " + s.path.string() +
                                       ": bytes from " + std::to_string(gap_begin) +
                                       " on were never written (" + std::to_string(e.num_bytes()) +
                                       " bytes in all)");
      }
    }
  }
  if (::fsync(s.fd) != 0) return ErrnoError("fsync of " + s.temp.string(), errno);
  const int fd = std::exchange(s.fd, -1);
  if (::close(fd) != 0) return ErrnoError("close of " + s.temp.string(), errno);
  if (s.options.overwrite) {
    if (::rename(s.temp.c_str(), s.path.c_str()) != 0) {
      return ErrnoError("rename " + s.temp.string() + " to " + s.path.string(), errno);
    }
    s.committed = true;
    const fs::path parent = s.path.has_parent_path() ? s.path.parent_path() : fs::path(".");
    return io::FsyncPath(parent);
  }
  Status renamed = io::RenameNoReplace(s.temp, s.path);
  // RenameNoReplace fails before or after the rename; only a missing temp file means it moved.
  std::error_code ec;
  if (!fs::exists(s.temp, ec)) s.committed = true;
  return renamed;
}

Status WriteSafetensorsFile(const fs::path& path, std::span<const NamedTensorView> tensors,
                            SafetensorsWriteOptions options) {
  std::vector<SafetensorsTensorSpec> specs;
  specs.reserve(tensors.size());
  for (const NamedTensorView& t : tensors) {
    UCP_RETURN_IF_ERROR(ValidateView(t.view, "tensor '" + t.name + "'"));
    specs.push_back({t.name, t.view.dtype, t.view.shape});
  }
  UCP_ASSIGN_OR_RETURN(SafetensorsWriter w,
                       SafetensorsWriter::Create(path, specs, std::move(options)));
  for (const NamedTensorView& t : tensors) {
    UCP_RETURN_IF_ERROR(w.WriteTensor(t.name, t.view));
  }
  return w.Commit();
}

}  // namespace ucp::safetensors
