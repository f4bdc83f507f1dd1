// Token files: a strict reader over a read-only mapping, and an atomic writer built on
// ucp/io/atomic_file.h. The reader has one named error per rule (the corruption catalogue in
// token_file_test.cc holds one bad file for each).
#include "offload/data/token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"

namespace ucp::offload {
namespace fs = std::filesystem;

// The mapping is read in place as uint16 and the header as int32: both are little-endian in the
// file, so a big-endian host would need a swapping copy that nothing here provides.
static_assert(std::endian::native == std::endian::little,
              "token files are read in place; a big-endian host needs a byte-swapping reader");

namespace {

constexpr int64_t kHeaderBytes = kTokenFileHeaderInts * 4;
// llm.c's other token format (dev/data/data_common.py, "llama-3": uint32 tokens, version 7).
constexpr int32_t kLlama3Magic = 20240801;

int32_t LoadLe32(const unsigned char* p) {
  uint32_t v = uint32_t{p[0]} | uint32_t{p[1]} << 8 | uint32_t{p[2]} << 16 | uint32_t{p[3]} << 24;
  return static_cast<int32_t>(v);
}

void StoreLe32(int32_t value, unsigned char* p) {
  const auto v = static_cast<uint32_t>(value);
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

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

 private:
  int fd_;
};

}  // namespace

struct TokenFile::Impl {
  fs::path path;
  void* map = nullptr;  // the whole file, PROT_READ
  size_t map_bytes = 0;
  std::span<const uint16_t> tokens;

  ~Impl() {
    if (map != nullptr) ::munmap(map, map_bytes);
  }
};

TokenFile::TokenFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TokenFile::TokenFile(TokenFile&&) noexcept = default;
TokenFile& TokenFile::operator=(TokenFile&&) noexcept = default;
TokenFile::~TokenFile() = default;

std::span<const uint16_t> TokenFile::tokens() const { return impl_->tokens; }
const fs::path& TokenFile::path() const { return impl_->path; }

Result<TokenFile> TokenFile::Open(const fs::path& path) {
  const std::string name = "token file " + path.string();
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; the fstat
  // below then refuses it (and anything else that is not a regular file) before any read.
  int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (raw < 0) {
    if (errno == ENOENT) return NotFoundError(name + " does not exist");
    return ErrnoError("open " + name, errno);
  }
  Fd fd(raw);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError("stat " + name, errno);
  if (!S_ISREG(st.st_mode)) {
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISBLK(st.st_mode)  ? "a block device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    return FailedPreconditionError(name + " is " + kind + ", not a regular file");
  }
  const int64_t size_bytes = st.st_size;
  if (size_bytes < kHeaderBytes) {
    return DataLossError(name + ": short header: the file is " + std::to_string(size_bytes) +
                         " bytes, the header alone is " + std::to_string(kHeaderBytes) + " bytes");
  }

  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->map_bytes = static_cast<size_t>(size_bytes);
  void* map = ::mmap(nullptr, impl->map_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) return ErrnoError("mmap " + name, errno);
  impl->map = map;
  const auto* bytes = static_cast<const unsigned char*>(map);

  const int32_t magic = LoadLe32(bytes);
  if (magic == kLlama3Magic) {
    return UnimplementedError(name + ": header[0] (magic) is " + std::to_string(magic) +
                              ", llm.c's llama-3 format with uint32 tokens; only the uint16 format "
                              "(magic " +
                              std::to_string(kTokenFileMagic) + ") is read");
  }
  if (magic != kTokenFileMagic) {
    return DataLossError(name + ": header[0] (magic) is " + std::to_string(magic) + ", expected " +
                         std::to_string(kTokenFileMagic) + "; not an llm.c token file");
  }
  const int32_t version = LoadLe32(bytes + 4);
  if (version != kTokenFileVersion) {
    return DataLossError(name + ": header[1] (version) is " + std::to_string(version) +
                         ", expected " + std::to_string(kTokenFileVersion));
  }
  const int32_t count = LoadLe32(bytes + 8);
  if (count < 0) {
    return DataLossError(name + ": header[2] (token count) is " + std::to_string(count) +
                         ", negative");
  }
  const int64_t data_bytes = size_bytes - kHeaderBytes;
  if (data_bytes % 2 != 0) {
    return DataLossError(name + ": odd size: " + std::to_string(data_bytes) +
                         " bytes after the header are not a whole number of uint16 tokens");
  }
  // count <= INT32_MAX, so 2 * count and the total fit in int64 with room to spare.
  const int64_t expected_bytes = kHeaderBytes + 2 * int64_t{count};
  if (size_bytes < expected_bytes) {
    return DataLossError(name + ": truncated: header[2] (token count) is " + std::to_string(count) +
                         ", which needs " + std::to_string(expected_bytes) +
                         " bytes, but the file is " + std::to_string(size_bytes) + " bytes (" +
                         std::to_string(data_bytes / 2) + " tokens)");
  }
  if (size_bytes > expected_bytes) {
    return DataLossError(name + ": trailing bytes: header[2] (token count) is " +
                         std::to_string(count) + ", which needs " + std::to_string(expected_bytes) +
                         " bytes, but the file is " + std::to_string(size_bytes) + " bytes (" +
                         std::to_string(size_bytes - expected_bytes) + " bytes too many)");
  }
  // The mapping is page-aligned and the header is 1024 bytes, so the tokens are 2-aligned.
  impl->tokens = std::span<const uint16_t>(reinterpret_cast<const uint16_t*>(bytes + kHeaderBytes),
                                           static_cast<size_t>(count));
  return TokenFile(std::move(impl));
}

Status WriteTokenFile(const fs::path& path, std::span<const uint16_t> tokens) {
  const std::string name = "token file " + path.string();
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgumentError(name + ": " + std::to_string(tokens.size()) +
                                " tokens do not fit header[2] (token count), an int32");
  }
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path, ec))) {
    return AlreadyExistsError(name + " already exists; ucp never overwrites");
  }
  // One buffer, so the bytes go through io::WriteFileAtomic (temp file, fsync, rename, fsync of
  // the folder). It writes under a private temporary folder next to `path`, and the result is
  // then moved with RenameNoReplace, so a file that appears at `path` meanwhile is never
  // replaced and an interrupted write leaves only a `.tmp-` name behind.
  std::vector<unsigned char> bytes(static_cast<size_t>(kHeaderBytes) + 2 * tokens.size(), 0);
  StoreLe32(kTokenFileMagic, bytes.data());
  StoreLe32(kTokenFileVersion, bytes.data() + 4);
  StoreLe32(static_cast<int32_t>(tokens.size()), bytes.data() + 8);
  if (!tokens.empty()) {
    std::memcpy(bytes.data() + kHeaderBytes, tokens.data(), 2 * tokens.size());  // little-endian
  }

  UCP_ASSIGN_OR_RETURN(const fs::path tmp_dir, io::MakeTempSiblingDir(path),
                       "while writing " + name);
  const fs::path tmp_file = tmp_dir / path.filename();
  Status st = io::WriteFileAtomic(tmp_file, std::as_bytes(std::span(bytes)));
  if (st.ok()) st = io::RenameNoReplace(tmp_file, path);
  io::RemoveTreeBestEffort(tmp_dir);
  if (!st.ok()) return std::move(st).WithContext("while writing " + name);
  return Status::Ok();
}

}  // namespace ucp::offload
