// ByteSource over pread or a buffer, and a table-driven CRC-32 (slicing-by-8).
#include "ucp/io/torch/byte_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
  io::CountSourceBytesRead(n);
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

namespace {

#if defined(__x86_64__)
// Carry-less multiplication folding (PCLMULQDQ), about 10x slicing-by-8: verified conversions
// checksum every byte they read, and the CRC is then most of their CPU time. Four 128-bit lanes
// fold 64 bytes per step: each lane L becomes L.lo * k1 ^ L.hi * k2 ^ next 16 bytes, where k1,
// k2 are x^(4*128+32) and x^(4*128-32) mod P in the CRC's reflected bit order (k3, k4 the same
// for one lane, 128 bits); the 128-bit remainder is then reduced to 64 bits (k5 = x^64 mod P)
// and to 32 by Barrett reduction (P' = P with its x^32 term, mu = x^64 / P). Works on the
// conditioned CRC value `c` (~crc) and on whole 16-byte blocks, at least 64 bytes of them.
#define UCP_PCLMUL __attribute__((target("pclmul,sse4.1")))
UCP_PCLMUL inline __m128i Load16(const std::byte* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}
// lane.lo * k.lo ^ lane.hi * k.hi ^ next.
UCP_PCLMUL inline __m128i Fold16(__m128i lane, __m128i k, __m128i next) {
  return _mm_xor_si128(
      _mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x00), _mm_clmulepi64_si128(lane, k, 0x11)),
      next);
}

UCP_PCLMUL uint32_t Crc32Fold(const std::byte* p, size_t n, uint32_t c) {
  const __m128i k1k2 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
  const __m128i k3k4 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
  const __m128i k5 = _mm_set_epi64x(0, 0x0163cd6124);
  const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
  const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
  __m128i x1 = _mm_xor_si128(Load16(p), _mm_cvtsi32_si128(static_cast<int>(c)));
  __m128i x2 = Load16(p + 16), x3 = Load16(p + 32), x4 = Load16(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x1 = Fold16(x1, k1k2, Load16(p));
    x2 = Fold16(x2, k1k2, Load16(p + 16));
    x3 = Fold16(x3, k1k2, Load16(p + 32));
    x4 = Fold16(x4, k1k2, Load16(p + 48));
  }
  x1 = Fold16(x1, k3k4, x2);
  x1 = Fold16(x1, k3k4, x3);
  x1 = Fold16(x1, k3k4, x4);
  for (; n >= 16; p += 16, n -= 16) x1 = Fold16(x1, k3k4, Load16(p));
  // 128 -> 64 bits: the low half times k4, added to the high half.
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k3k4, 0x10));
  // 64 -> 32 bits (+ 32 zero bits): the low 32 bits times k5, added to the rest.
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 4),
                     _mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00));
  // Barrett: q = (R.lo32 * mu).lo32, R ^= q * P'; the remainder is in bits 32..63.
  __m128i q = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
  q = _mm_clmulepi64_si128(_mm_and_si128(q, low32), poly, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x1, q), 1));
}
#undef UCP_PCLMUL

bool HasPclmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}
#endif

}  // namespace

uint32_t Crc32(std::span<const std::byte> bytes, uint32_t crc) {
  static_assert(std::endian::native == std::endian::little, "slicing-by-8 reads little-endian");
  uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
#if defined(__x86_64__)
  if (n >= 64 && HasPclmul()) {
    const size_t whole = n & ~size_t{15};
    c = Crc32Fold(p, whole, c);
    p += whole;
    n -= whole;
  }
#endif
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
