// ZipWriter: local headers with alignment padding, central directory, zip64 end records, and the
// temp-file + fsync + rename + directory-fsync sequence. (A local streaming helper: the io
// module's WriteFileAtomic takes one buffer, and a torch file is many caller-owned pieces.)
#include "ucp/io/torch/zip_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/torch/byte_source.h"

namespace ucp::torch {
namespace {

constexpr uint32_t k32Max = 0xFFFFFFFF;
constexpr size_t kBufferBytes = 1 << 16;

void Put16(std::string& s, uint16_t v) {
  s.push_back(static_cast<char>(v & 0xFF));
  s.push_back(static_cast<char>(v >> 8));
}
void Put32(std::string& s, uint32_t v) {
  Put16(s, static_cast<uint16_t>(v & 0xFFFF));
  Put16(s, static_cast<uint16_t>(v >> 16));
}
void Put64(std::string& s, uint64_t v) {
  Put32(s, static_cast<uint32_t>(v & k32Max));
  Put32(s, static_cast<uint32_t>(v >> 32));
}

Status FsyncDir(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("cannot open directory " + dir.string() + " to fsync it", errno);
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError("fsync of directory " + dir.string() + " failed", e);
  return Status::Ok();
}

}  // namespace

Result<ZipWriter> ZipWriter::Create(const std::filesystem::path& path, ZipWriteOptions options) {
  if (options.alignment < 1 || options.alignment > 4096 ||
      (options.alignment & (options.alignment - 1)) != 0) {
    return InvalidArgumentError("zip alignment " + std::to_string(options.alignment) +
                                " is not a power of two in [1, 4096]");
  }
  ZipWriter w;
  w.path_ = path;
  w.options_ = options;
  std::string templ = path.string() + ".tmp-XXXXXX";
  int fd = ::mkstemp(templ.data());
  if (fd < 0) return ErrnoError("cannot create a temporary file for " + path.string(), errno);
  w.fd_ = fd;
  w.temp_ = templ;
  // mkstemp makes the file 0600; a checkpoint gets the mode torch.save's open(2) gives: 0666 less
  // the umask.
  if (::fchmod(fd, 0666 & ~io::ProcessUmask()) != 0) return ErrnoError("cannot chmod " + templ, errno);
  return w;
}

ZipWriter::ZipWriter(ZipWriter&& o) noexcept
    : path_(std::move(o.path_)),
      temp_(std::move(o.temp_)),
      options_(o.options_),
      fd_(o.fd_),
      offset_(o.offset_),
      buf_(std::move(o.buf_)),
      entries_(std::move(o.entries_)),
      reserved_(std::move(o.reserved_)),
      names_(std::move(o.names_)),
      finished_(o.finished_) {
  o.fd_ = -1;
  o.temp_.clear();
}

ZipWriter::~ZipWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && !temp_.empty()) ::unlink(temp_.c_str());
}

Status ZipWriter::WriteRaw(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write to " + temp_.string() + " failed", errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status ZipWriter::Flush() {
  UCP_RETURN_IF_ERROR(WriteRaw(buf_.data(), buf_.size()));
  buf_.clear();
  return Status::Ok();
}

Status ZipWriter::Buffer(std::string_view bytes) {
  buf_.append(bytes);
  offset_ += bytes.size();
  if (buf_.size() >= kBufferBytes) return Flush();
  return Status::Ok();
}

Status ZipWriter::AddRecord(std::string_view name, std::string_view data) {
  std::span<const std::byte> piece = std::as_bytes(std::span<const char>(data.data(), data.size()));
  return AddRecord(name, std::span<const std::span<const std::byte>>(&piece, 1));
}

Result<ZipWriter::Entry> ZipWriter::AppendHeader(std::string_view name, uint64_t size,
                                                 uint32_t crc) {
  if (finished_) return InvalidArgumentError("zip writer for " + path_.string() + " is finished");
  if (name.empty() || name.size() > 0xFFFF || name.front() == '/' ||
      name.find("..") != std::string_view::npos) {
    return InvalidArgumentError("zip record name '" + std::string(name) + "' is not allowed");
  }
  if (!names_.insert(std::string(name)).second) {
    return InvalidArgumentError("duplicate zip record '" + std::string(name) + "'");
  }
  Entry e;
  e.name = std::string(name);
  e.offset = offset_;
  e.size = size;
  e.crc = crc;
  e.zip64 = options_.force_zip64 || e.size >= k32Max || e.offset >= k32Max;

  std::string h;
  Put32(h, 0x04034b50);
  Put16(h, e.zip64 ? 45 : 20);
  Put16(h, 0x0800);  // UTF-8 names; sizes are known, so no data descriptor
  Put16(h, 0);       // stored
  Put32(h, 0);       // time, date
  Put32(h, e.crc);
  Put32(h, e.zip64 ? k32Max : static_cast<uint32_t>(e.size));
  Put32(h, e.zip64 ? k32Max : static_cast<uint32_t>(e.size));
  Put16(h, static_cast<uint16_t>(name.size()));
  std::string extra;
  if (e.zip64) {
    Put16(extra, 0x0001);
    Put16(extra, 16);
    Put64(extra, e.size);
    Put64(extra, e.size);
  }
  const uint64_t base = offset_ + 30 + name.size() + extra.size() + 4;
  const uint64_t a = static_cast<uint64_t>(options_.alignment);
  const uint64_t pad = (a - base % a) % a;
  Put16(extra, 0x4246);  // "FB": padding so the data is aligned
  Put16(extra, static_cast<uint16_t>(pad));
  extra.append(pad, 'Z');
  Put16(h, static_cast<uint16_t>(extra.size()));
  h.append(name);
  h += extra;
  UCP_RETURN_IF_ERROR(Buffer(h));
  return e;
}

Status ZipWriter::AddRecord(std::string_view name,
                            std::span<const std::span<const std::byte>> pieces) {
  uint32_t crc = 0;
  uint64_t size = 0;
  for (auto p : pieces) {
    crc = Crc32(p, crc);
    size += p.size();
  }
  UCP_ASSIGN_OR_RETURN(Entry e, AppendHeader(name, size, crc));
  for (auto p : pieces) {
    if (p.size() < kBufferBytes) {
      UCP_RETURN_IF_ERROR(
          Buffer(std::string_view(reinterpret_cast<const char*>(p.data()), p.size())));
    } else {
      UCP_RETURN_IF_ERROR(Flush());
      UCP_RETURN_IF_ERROR(WriteRaw(p.data(), p.size()));
      offset_ += p.size();
    }
  }
  entries_.push_back(std::move(e));
  return Status::Ok();
}

Result<int32_t> ZipWriter::ReserveRecord(std::string_view name, uint64_t size) {
  UCP_ASSIGN_OR_RETURN(Entry e, AppendHeader(name, size, 0));
  UCP_RETURN_IF_ERROR(Flush());
  auto r = std::make_unique<Reserved>();
  r->entry = entries_.size();
  r->data_offset = offset_;
  entries_.push_back(std::move(e));
  // The data is left as a hole; WriteReserved fills it with pwrite, and appends continue after.
  offset_ += size;
  if (::lseek(fd_, static_cast<off_t>(offset_), SEEK_SET) < 0) {
    return ErrnoError("seek in " + temp_.string() + " failed", errno);
  }
  reserved_.push_back(std::move(r));
  return static_cast<int32_t>(reserved_.size() - 1);
}

Status ZipWriter::WriteReserved(int32_t record, uint64_t offset, std::span<const std::byte> data) {
  if (finished_ || record < 0 || static_cast<size_t>(record) >= reserved_.size()) {
    return InvalidArgumentError("zip writer for " + path_.string() +
                                " has no open reserved record " + std::to_string(record));
  }
  Reserved& r = *reserved_[static_cast<size_t>(record)];
  const Entry& e = entries_[r.entry];
  if (offset > e.size || data.size() > e.size - offset) {
    return InvalidArgumentError("bytes [" + std::to_string(offset) + ", " +
                                std::to_string(offset + data.size()) + ") are outside record '" +
                                e.name + "' of " + std::to_string(e.size) + " bytes in " +
                                path_.string());
  }
  const char* p = reinterpret_cast<const char*>(data.data());
  size_t n = data.size();
  uint64_t at = r.data_offset + offset;
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(at));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write of record '" + e.name + "' to " + temp_.string() + " failed", errno);
    }
    p += w;
    at += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
  const uint32_t crc = Crc32(data);
  std::lock_guard<std::mutex> lock(r.mu);
  r.pieces.push_back({offset, data.size(), crc});
  return Status::Ok();
}

Status ZipWriter::FinishReserved(Reserved& r) {
  Entry& e = entries_[r.entry];
  std::sort(r.pieces.begin(), r.pieces.end(),
            [](const Reserved::Piece& a, const Reserved::Piece& b) { return a.offset < b.offset; });
  uint64_t at = 0;
  uint32_t crc = 0;
  for (const Reserved::Piece& piece : r.pieces) {
    if (piece.size == 0) continue;
    if (piece.offset != at) {
      return InternalError(
          "record '" + e.name + "' of " + path_.string() + ": " +
          (piece.offset > at ? "no bytes written at " : "bytes written twice at ") +
          std::to_string(std::min(piece.offset, at)));
    }
    crc = Crc32Combine(crc, piece.crc, static_cast<int64_t>(piece.size));
    at += piece.size;
  }
  if (at != e.size) {
    return InternalError("record '" + e.name + "' of " + path_.string() + ": no bytes written at " +
                         std::to_string(at) + " of " + std::to_string(e.size));
  }
  e.crc = crc;
  std::string le;
  Put32(le, crc);
  // The CRC field of the local header is 14 bytes into it.
  if (::pwrite(fd_, le.data(), le.size(), static_cast<off_t>(e.offset + 14)) !=
      static_cast<ssize_t>(le.size())) {
    return ErrnoError(
        "write of the header of record '" + e.name + "' to " + temp_.string() + " failed", errno);
  }
  r.pieces.clear();
  r.pieces.shrink_to_fit();
  return Status::Ok();
}

Status ZipWriter::Finish() {
  if (finished_) return InvalidArgumentError("zip writer for " + path_.string() + " is finished");
  for (auto& r : reserved_) UCP_RETURN_IF_ERROR(FinishReserved(*r));
  const uint64_t cd_offset = offset_;
  for (const Entry& e : entries_) {
    const bool big_size = e.zip64, big_off = e.zip64;
    std::string c;
    Put32(c, 0x02014b50);
    Put16(c, 45);  // made by
    Put16(c, e.zip64 ? 45 : 20);
    Put16(c, 0x0800);
    Put16(c, 0);
    Put32(c, 0);
    Put32(c, e.crc);
    Put32(c, big_size ? k32Max : static_cast<uint32_t>(e.size));
    Put32(c, big_size ? k32Max : static_cast<uint32_t>(e.size));
    Put16(c, static_cast<uint16_t>(e.name.size()));
    std::string extra;
    if (e.zip64) {
      Put16(extra, 0x0001);
      Put16(extra, 24);
      Put64(extra, e.size);
      Put64(extra, e.size);
      Put64(extra, e.offset);
    }
    Put16(c, static_cast<uint16_t>(extra.size()));
    Put16(c, 0);  // comment
    Put16(c, 0);  // disk
    Put16(c, 0);  // internal attributes
    Put32(c, 0);  // external attributes
    Put32(c, big_off ? k32Max : static_cast<uint32_t>(e.offset));
    c += e.name;
    c += extra;
    UCP_RETURN_IF_ERROR(Buffer(c));
  }
  const uint64_t cd_size = offset_ - cd_offset;
  const uint64_t z64_offset = offset_;
  const uint64_t n = entries_.size();
  std::string end;
  Put32(end, 0x06064b50);
  Put64(end, 44);
  Put16(end, 45);
  Put16(end, 45);
  Put32(end, 0);
  Put32(end, 0);
  Put64(end, n);
  Put64(end, n);
  Put64(end, cd_size);
  Put64(end, cd_offset);
  Put32(end, 0x07064b50);
  Put32(end, 0);
  Put64(end, z64_offset);
  Put32(end, 1);
  Put32(end, 0x06054b50);
  Put16(end, 0);
  Put16(end, 0);
  Put16(end, static_cast<uint16_t>(n >= 0xFFFF ? 0xFFFF : n));
  Put16(end, static_cast<uint16_t>(n >= 0xFFFF ? 0xFFFF : n));
  Put32(end, cd_size >= k32Max ? k32Max : static_cast<uint32_t>(cd_size));
  Put32(end, cd_offset >= k32Max ? k32Max : static_cast<uint32_t>(cd_offset));
  Put16(end, 0);
  UCP_RETURN_IF_ERROR(Buffer(end));
  UCP_RETURN_IF_ERROR(Flush());
  if (options_.sync) {
    if (::fsync(fd_) != 0) return ErrnoError("fsync of " + temp_.string() + " failed", errno);
  } else {
#ifdef __linux__
    // Writeback starts now; whoever commits the folder fsyncs it (nobody waits here).
    (void)::sync_file_range(fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
#endif
  }
  if (::close(fd_) != 0) {
    fd_ = -1;
    return ErrnoError("close of " + temp_.string() + " failed", errno);
  }
  fd_ = -1;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    return ErrnoError("rename of " + temp_.string() + " to " + path_.string() + " failed", errno);
  }
  finished_ = true;
  return options_.sync ? FsyncDir(path_.parent_path()) : Status::Ok();
}

}  // namespace ucp::torch
