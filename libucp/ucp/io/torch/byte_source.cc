// ByteSource over pread or a buffer, and a table-driven CRC-32 (slicing-by-8).
#include "ucp/io/torch/byte_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>

#include "ucp/base/status_macros.h"

namespace ucp::torch {

Result<std::shared_ptr<const ByteSource>> ByteSource::OpenFile(const std::filesystem::path& path) {
  // O_NONBLOCK so that a FIFO in place of the file cannot block the open (refused below).
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int e = errno;
    if (e == ENOENT) return NotFoundError("torch file " + path.string() + " does not exist");
    return ErrnoError("cannot open torch file " + path.string(), e);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoError("cannot stat torch file " + path.string(), e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return IoError("torch file " + path.string() + " is not a regular file");
  }
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoError("cannot open torch file " + path.string(), e);
  }
  std::shared_ptr<ByteSource> src(new ByteSource());
  src->fd_ = fd;
  src->size_ = st.st_size;
  src->identity_.device = static_cast<uint64_t>(st.st_dev);
  src->identity_.inode = static_cast<uint64_t>(st.st_ino);
  src->identity_.size_bytes = static_cast<int64_t>(st.st_size);
  src->identity_.mtime_ns =
      static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  src->name_ = path.string();
  return std::shared_ptr<const ByteSource>(std::move(src));
}

Status ByteSource::CheckUnchanged() const {
  if (fd_ < 0) return Status::Ok();
  return io::CheckFileUnchanged(name_, identity_);
}

std::shared_ptr<const ByteSource> ByteSource::FromBuffer(std::span<const std::byte> bytes,
                                                         std::string name) {
  std::shared_ptr<ByteSource> src(new ByteSource());
  src->buffer_.assign(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  src->size_ = static_cast<int64_t>(bytes.size());
  src->name_ = std::move(name);
  return src;
}

ByteSource::~ByteSource() {
  if (fd_ >= 0) ::close(fd_);
}

Status ByteSource::ReadAt(int64_t offset, std::span<std::byte> out) const {
  const int64_t n = static_cast<int64_t>(out.size());
  if (offset < 0 || offset > size_ || n > size_ - offset) {
    return DataLossError("read of " + std::to_string(n) + " bytes at offset " +
                         std::to_string(offset) + " is past the end of " + name_ + " (" +
                         std::to_string(size_) + " bytes)");
  }
  if (fd_ < 0) {
    if (n > 0) std::memcpy(out.data(), buffer_.data() + offset, out.size());
    return Status::Ok();
  }
  int64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd_, out.data() + done, static_cast<size_t>(n - done), offset + done);
    if (got < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("pread of " + std::to_string(n - done) + " bytes at offset " +
                            std::to_string(offset + done) + " of " + name_ + " failed",
                        errno);
    }
    if (got == 0) {
      return DataLossError(name_ + " shrank while reading: end of file at offset " +
                           std::to_string(offset + done));
    }
    done += got;
  }
  return Status::Ok();
}

Result<std::string> ByteSource::ReadString(int64_t offset, int64_t n) const {
  if (n < 0 || offset < 0 || offset > size_ || n > size_ - offset) {
    return DataLossError("read of " + std::to_string(n) + " bytes at offset " +
                         std::to_string(offset) + " is past the end of " + name_ + " (" +
                         std::to_string(size_) + " bytes)");
  }
  std::string s(static_cast<size_t>(n), '\0');
  UCP_RETURN_IF_ERROR(ReadAt(offset, std::as_writable_bytes(std::span<char>(s.data(), s.size()))));
  return s;
}

namespace {

// The reflected polynomial 0xEDB88320: table k holds the CRC of a byte followed by k zero bytes,
// so eight table lookups advance the CRC over eight input bytes at once (slicing-by-8).
constexpr std::array<std::array<uint32_t, 256>, 8> MakeCrcTables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i) {
    for (size_t k = 1; k < 8; ++k) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
  }
  return t;
}
constexpr std::array<std::array<uint32_t, 256>, 8> kCrcTables = MakeCrcTables();

}  // namespace

uint32_t Crc32Reference(std::span<const std::byte> bytes, uint32_t crc) {
  uint32_t c = ~crc;
  for (std::byte b : bytes) c = kCrcTables[0][(c ^ static_cast<uint8_t>(b)) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t Crc32(std::span<const std::byte> bytes, uint32_t crc) {
  static_assert(std::endian::native == std::endian::little, "slicing-by-8 reads little-endian");
  uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
  const auto& t = kCrcTables;
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = t[0][(c ^ static_cast<uint8_t>(*p)) & 0xFF] ^ (c >> 8);
  return ~c;
}

namespace {

// Polynomials over GF(2) in the reflected bit order of the CRC (bit 31 is x^0): a * b mod P.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = uint32_t{1} << 31;
  uint32_t p = 0;
  for (;;) {
    if ((a & m) != 0) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) != 0 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
  }
  return p;
}

// x^(2^k) mod P for k = 0..63 (k = 3 is one byte's shift).
constexpr size_t kX2nSize = 64;
const std::array<uint32_t, kX2nSize>& X2nTable() {
  static const std::array<uint32_t, kX2nSize> table = [] {
    std::array<uint32_t, kX2nSize> t{};
    uint32_t p = uint32_t{1} << 30;  // x^1
    t[0] = p;
    for (size_t k = 1; k < kX2nSize; ++k) t[k] = p = MultModP(p, p);
    return t;
  }();
  return table;
}

}  // namespace

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b) {
  // Appending len_b bytes multiplies A's remainder by x^(8 len_b); the pre- and post-conditioning
  // (~) of the two CRCs cancel in the xor, as they do in zlib's crc32_combine.
  uint32_t shift = uint32_t{1} << 31;  // x^0
  const auto& table = X2nTable();
  for (size_t k = 3; len_b > 0; len_b >>= 1, ++k) {
    if ((len_b & 1) != 0) shift = MultModP(table[k % kX2nSize], shift);
  }
  return MultModP(shift, crc_a) ^ crc_b;
}

}  // namespace ucp::torch
