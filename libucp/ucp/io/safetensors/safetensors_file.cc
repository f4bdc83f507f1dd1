// SafetensorsFile over open(O_NONBLOCK) + fstat + pread, or over a copied buffer.
#include "ucp/io/safetensors/safetensors_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "ucp/base/status_macros.h"

namespace ucp::safetensors {

namespace {

std::string FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a fifo";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : name_(std::move(o.name_)),
      fd_(std::exchange(o.fd_, -1)),
      buffer_(std::move(o.buffer_)),
      file_size_bytes_(o.file_size_bytes_),
      identity_(o.identity_),
      header_(std::move(o.header_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    name_ = std::move(o.name_);
    fd_ = std::exchange(o.fd_, -1);
    buffer_ = std::move(o.buffer_);
    file_size_bytes_ = o.file_size_bytes_;
    identity_ = o.identity_;
    header_ = std::move(o.header_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

Result<SafetensorsFile> SafetensorsFile::Open(const std::filesystem::path& path,
                                              const SafetensorsReadOptions& options) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. It has no
  // effect on the reads of a regular file, the only kind accepted below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return NotFoundError("safetensors file " + path.string() + " does not exist");
    return ErrnoError("cannot open safetensors file " + path.string(), e);
  }
  SafetensorsFile f;
  f.fd_ = fd;
  f.name_ = path.string();
  struct stat st {};
  if (::fstat(fd, &st) != 0) return ErrnoError("cannot stat safetensors file " + f.name_, errno);
  if (!S_ISREG(st.st_mode)) {
    return DataLossError("safetensors file " + f.name_ + " is " + FileKind(st.st_mode) +
                         ", not a regular file");
  }
  f.file_size_bytes_ = static_cast<int64_t>(st.st_size);
  UCP_ASSIGN_OR_RETURN(f.identity_, io::FdFileIdentity(fd), f.name_);
  return Load(std::move(f), options);
}

Status SafetensorsFile::CheckUnchanged() const {
  if (fd_ < 0) return Status::Ok();
  return io::CheckFileUnchanged(name_, identity_);
}

Result<SafetensorsFile> SafetensorsFile::OpenBuffer(std::span<const std::byte> bytes,
                                                    std::string name,
                                                    const SafetensorsReadOptions& options) {
  SafetensorsFile f;
  f.name_ = std::move(name);
  f.buffer_.assign(bytes.begin(), bytes.end());
  f.file_size_bytes_ = static_cast<int64_t>(bytes.size());
  return Load(std::move(f), options);
}

Result<SafetensorsFile> SafetensorsFile::Load(SafetensorsFile f,
                                              const SafetensorsReadOptions& options) {
  std::byte size_bytes[kHeaderSizeBytes] = {};
  const auto prefix_size = std::min<int64_t>(kHeaderSizeBytes, f.file_size_bytes_);
  UCP_RETURN_IF_ERROR(f.ReadAt(0, std::span<std::byte>(size_bytes, prefix_size)));
  UCP_ASSIGN_OR_RETURN(const int64_t n,
                       ParseHeaderSize(std::span<const std::byte>(size_bytes, prefix_size),
                                       f.file_size_bytes_, f.name_, options.max_header_bytes));
  std::vector<std::byte> text(static_cast<size_t>(n));
  UCP_RETURN_IF_ERROR(f.ReadAt(kHeaderSizeBytes, text));
  UCP_ASSIGN_OR_RETURN(f.header_, ParseHeader(text, f.file_size_bytes_, f.name_));
  return f;
}

Status SafetensorsFile::ReadAt(int64_t offset, std::span<std::byte> out) const {
  const auto n = static_cast<int64_t>(out.size());
  if (fd_ < 0) {
    // Ranges were checked against the buffer's size by the callers.
    if (n > 0) std::memcpy(out.data(), buffer_.data() + offset, out.size());
    return Status::Ok();
  }
  int64_t done = 0;
  while (done < n) {
    const ssize_t got =
        ::pread(fd_, out.data() + done, static_cast<size_t>(n - done), offset + done);
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("pread of " + std::to_string(n - done) + " bytes at offset " +
                            std::to_string(offset + done) + " of safetensors file " + name_,
                        errno);
    }
    if (got == 0) {
      return DataLossError(
          "safetensors file " + name_ + " shrank since it was opened: end of file at offset " +
          std::to_string(offset + done) + " of " + std::to_string(file_size_bytes_) + " bytes");
    }
    done += got;
  }
  return Status::Ok();
}

Result<const SafetensorsEntry*> SafetensorsFile::Find(std::string_view tensor_name) const {
  for (const SafetensorsEntry& e : header_.entries) {
    if (e.name == tensor_name) return &e;
  }
  return NotFoundError("tensor '" + std::string(tensor_name) + "' is not in safetensors file " +
                       name_);
}

Status SafetensorsFile::ReadRange(const SafetensorsEntry& tensor, int64_t byte_begin,
                                  int64_t byte_end, std::span<std::byte> out) const {
  const auto& all = header_.entries;
  if (all.empty() || &tensor < all.data() || &tensor >= all.data() + all.size()) {
    return InvalidArgumentError("tensor '" + tensor.name +
                                "' is not an entry of safetensors file " + name_);
  }
  if (byte_begin < 0 || byte_end < byte_begin || byte_end > tensor.num_bytes()) {
    return OutOfRangeError("bytes [" + std::to_string(byte_begin) + ", " +
                           std::to_string(byte_end) + ") are not within tensor '" + tensor.name +
                           "' (" + std::to_string(tensor.num_bytes()) +
                           " bytes) of safetensors file " + name_);
  }
  if (static_cast<int64_t>(out.size()) != byte_end - byte_begin) {
    return InvalidArgumentError("reading bytes [" + std::to_string(byte_begin) + ", " +
                                std::to_string(byte_end) + ") of tensor '" + tensor.name +
                                "' of safetensors file " + name_ + " into " +
                                std::to_string(out.size()) + " bytes");
  }
  // No overflow: the header check put every entry inside the file.
  return ReadAt(header_.data_offset() + tensor.data_begin + byte_begin, out);
}

Result<Tensor> SafetensorsFile::ReadTensor(const SafetensorsEntry& tensor) const {
  UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Uninitialized(tensor.dtype, tensor.shape),
                       "while reading tensor '" + tensor.name + "' of " + name_);
  UCP_RETURN_IF_ERROR(ReadRange(tensor, 0, tensor.num_bytes(), t.view().bytes));
  return t;
}

}  // namespace ucp::safetensors
