// TorchFile: format detection, the zip and legacy layouts, storage records and tensor reads.
#include "ucp/io/torch/torch_file.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "ucp/base/checked_math.h"
#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/read_verifier.h"
#include "ucp/io/torch/zip_reader.h"

namespace ucp::torch {
namespace {

// Pickle protocol 2, LONG1 of 10 bytes holding 0x1950a86a20f9469cfc6c, STOP (formats.md 1.1).
constexpr unsigned char kLegacyMagic[15] = {0x80, 0x02, 0x8A, 0x0A, 0x6C, 0xFC, 0x9C, 0x46,
                                            0xF9, 0x20, 0x6A, 0xA8, 0x50, 0x19, 0x2E};
constexpr int64_t kLegacyProtocol = 1001;
constexpr int64_t kMinZipVersion = 1;
constexpr int64_t kMaxZipVersion = 10;

std::string Num(int64_t v) { return std::to_string(v); }

struct Storages {
  std::unordered_map<std::string, size_t> index;  // key -> position in records
  std::vector<StorageRecord> records;
  std::unordered_map<std::string, const PyValue*> nodes;  // key -> the storage PyValue
};

// Parses ('storage', torch.XStorage, key, location, numel[, view_metadata]).
Result<StorageRef> ParseStoragePid(const PyValue& pid, bool legacy) {
  const size_t want = legacy ? 6 : 5;
  if (pid.kind() != PyKind::kTuple || pid.items().size() != want) {
    return DataLossError("persistent id is not a " + Num(want) + "-tuple");
  }
  const auto& a = pid.items();
  if (a[0]->kind() != PyKind::kStr || a[0]->str() != "storage") {
    if (a[0]->kind() == PyKind::kStr && a[0]->str() == "module") {
      return UnimplementedError("persistent id of a pickled nn.Module class is not supported");
    }
    return DataLossError("persistent id does not start with 'storage'");
  }
  if (a[1]->kind() != PyKind::kGlobal) return DataLossError("storage type is not a global");
  UCP_ASSIGN_OR_RETURN(std::optional<DType> dtype, StorageDTypeFromClass(a[1]->str()));
  if (a[2]->kind() != PyKind::kStr || a[2]->str().empty()) {
    return DataLossError("storage key is not a non-empty str");
  }
  if (a[3]->kind() != PyKind::kStr) return DataLossError("storage location is not a str");
  if (a[4]->kind() != PyKind::kInt || a[4]->int_value() < 0) {
    return DataLossError("storage numel is not a non-negative int");
  }
  if (legacy && !a[5]->is_none()) {
    return UnimplementedError("storage view metadata (pre-1.0 files) is not supported");
  }
  StorageRef s;
  s.key = a[2]->str();
  s.location = a[3]->str();
  s.dtype = dtype;
  s.numel = a[4]->int_value();
  auto bytes = CheckedMul(s.numel, dtype ? DTypeSizeBytes(*dtype) : 1);
  if (!bytes) return DataLossError("storage '" + s.key + "' numel " + Num(s.numel) + " overflows");
  s.num_bytes = *bytes;
  return s;
}

// A storage seen before must be described the same way each time.
Result<const PyValue*> RememberStorage(Storages& st, PyArena& arena, StorageRef s) {
  auto it = st.nodes.find(s.key);
  if (it != st.nodes.end()) {
    const StorageRef& old = it->second->storage();
    if (old.dtype != s.dtype || old.numel != s.numel) {
      return DataLossError("storage '" + s.key + "' is referenced with numel " + Num(s.numel) +
                           " after numel " + Num(old.numel) + " or with another type");
    }
    return it->second;
  }
  const PyValue* node = arena.Storage(s);
  st.nodes.emplace(s.key, node);
  return node;
}

bool IsLegacyMagic(const std::string& head) {
  return head.size() >= sizeof(kLegacyMagic) &&
         std::memcmp(head.data(), kLegacyMagic, sizeof(kLegacyMagic)) == 0;
}

}  // namespace

struct TorchFile::Impl {
  std::shared_ptr<const ByteSource> source;
  TorchReadOptions options;
  TorchFormat format = TorchFormat::kZip;
  PyArena arena;
  const PyValue* root = nullptr;
  Storages storages;
  // VerifyReads: one checksummed record per storage record (same index), or null.
  std::unique_ptr<io::ReadVerifier> verifier;

  // Hands bytes [offset, offset + bytes.size()) of `rec`'s record to the verifier, if on.
  Status Observe(const StorageRecord& rec, int64_t offset, std::span<const std::byte> bytes) const {
    if (verifier == nullptr) return Status::Ok();
    return verifier->Observe(static_cast<int32_t>(&rec - storages.records.data()), offset, bytes);
  }

  Status OpenZip();
  Status OpenLegacy();
  Result<const StorageRecord*> Record(const StorageRef& s) const;
};

Status TorchFile::Impl::OpenZip() {
  const std::string& file = source->name();
  UCP_ASSIGN_OR_RETURN(ZipReader zip, ZipReader::Open(source));
  if (zip.Find("constants.pkl") != nullptr) {
    return UnimplementedError(file + " is a TorchScript archive (has constants.pkl)");
  }
  const ZipEntry* version = zip.Find("version");
  if (version == nullptr) version = zip.Find(".data/version");
  if (version == nullptr) {
    return DataLossError("zip torch file " + file + " has no 'version' record");
  }
  UCP_ASSIGN_OR_RETURN(std::string vtext, zip.ReadRecord(*version, 64, options.verify_crc32));
  while (!vtext.empty() && (vtext.back() == '\n' || vtext.back() == '\r')) vtext.pop_back();
  int64_t v = -1;
  auto [p, ec] = std::from_chars(vtext.data(), vtext.data() + vtext.size(), v);
  if (ec != std::errc() || p != vtext.data() + vtext.size() || vtext.empty()) {
    return DataLossError("version record of " + file + " is not a number: '" + vtext + "'");
  }
  if (v < kMinZipVersion || v > kMaxZipVersion) {
    return UnimplementedError("version " + Num(v) + " of " + file + " is outside the supported " +
                              Num(kMinZipVersion) + ".." + Num(kMaxZipVersion));
  }
  if (const ZipEntry* bo = zip.Find("byteorder")) {
    UCP_ASSIGN_OR_RETURN(std::string order, zip.ReadRecord(*bo, 64, options.verify_crc32));
    if (order == "big") return UnimplementedError(file + " was written big-endian");
    if (order != "little") {
      return DataLossError("byteorder record of " + file + " is '" + order + "'");
    }
  }
  const ZipEntry* pkl = zip.Find("data.pkl");
  if (pkl == nullptr) return DataLossError("zip torch file " + file + " has no data.pkl record");
  UCP_ASSIGN_OR_RETURN(std::string pickle,
                       zip.ReadRecord(*pkl, options.max_pickle_bytes, options.verify_crc32));
  auto pickle_src = ByteSource::FromBuffer(
      std::as_bytes(std::span<const char>(pickle.data(), pickle.size())), "data.pkl of " + file);
  PersistentLoader load = [&](const PyValue& pid) -> Result<const PyValue*> {
    UCP_ASSIGN_OR_RETURN(StorageRef s, ParseStoragePid(pid, false));
    if (!storages.index.count(s.key)) {
      const ZipEntry* e = zip.Find("data/" + s.key);
      if (e == nullptr) {
        return DataLossError("storage '" + s.key + "' has no record 'data/" + s.key + "' in " +
                             file);
      }
      if (e->size != s.num_bytes) {
        return DataLossError("storage '" + s.key + "' of " + Num(s.numel) + " elements needs " +
                             Num(s.num_bytes) + " bytes, but its record in " + file + " has " +
                             Num(e->size));
      }
      storages.index.emplace(s.key, storages.records.size());
      storages.records.push_back({s.key, e->data_offset, e->size, e->crc32});
    }
    return RememberStorage(storages, arena, std::move(s));
  };
  UCP_ASSIGN_OR_RETURN(UnpickleResult r, Unpickle(*pickle_src, 0, pickle_src->size(), arena,
                                                  options.pickle, load, pickle_src->name()));
  if (r.end_offset != pickle_src->size()) {
    return DataLossError("data.pkl of " + file + " has " + Num(pickle_src->size() - r.end_offset) +
                         " bytes after its STOP opcode");
  }
  root = r.value;
  return Status::Ok();
}

Status TorchFile::Impl::OpenLegacy() {
  const std::string& file = source->name();
  const int64_t size = source->size();
  PickleOptions plain = options.pickle;
  plain.strict_globals = true;  // the header pickles hold plain values only
  int64_t pos = 0;
  auto next = [&](const std::string& what, const PersistentLoader& load,
                  const PickleOptions& o) -> Result<const PyValue*> {
    UCP_ASSIGN_OR_RETURN(UnpickleResult r,
                         Unpickle(*source, pos, size, arena, o, load, what + " of " + file));
    pos = r.end_offset;
    return r.value;
  };
  UCP_ASSIGN_OR_RETURN(const PyValue* magic, next("magic number pickle", nullptr, plain));
  if (magic->kind() != PyKind::kBigInt) return DataLossError("bad legacy magic number in " + file);
  UCP_ASSIGN_OR_RETURN(const PyValue* proto, next("protocol pickle", nullptr, plain));
  if (proto->kind() != PyKind::kInt || proto->int_value() != kLegacyProtocol) {
    return UnimplementedError("legacy protocol of " + file + " is not " + Num(kLegacyProtocol));
  }
  UCP_ASSIGN_OR_RETURN(const PyValue* sys_info, next("sys_info pickle", nullptr, plain));
  const PyValue* le = sys_info->Get("little_endian");
  if (le == nullptr || le->kind() != PyKind::kBool) {
    return DataLossError("sys_info of legacy file " + file + " has no little_endian bool");
  }
  if (!le->bool_value()) return UnimplementedError(file + " was written big-endian");

  std::unordered_map<std::string, StorageRef> refs;
  PersistentLoader load = [&](const PyValue& pid) -> Result<const PyValue*> {
    UCP_ASSIGN_OR_RETURN(StorageRef s, ParseStoragePid(pid, true));
    refs.emplace(s.key, s);
    return RememberStorage(storages, arena, std::move(s));
  };
  UCP_ASSIGN_OR_RETURN(root, next("main pickle", load, options.pickle));
  UCP_ASSIGN_OR_RETURN(const PyValue* keys, next("storage key list", nullptr, plain));
  if (keys->kind() != PyKind::kList) {
    return DataLossError("storage key list of " + file + " is a " +
                         std::string(PyKindName(keys->kind())));
  }
  if (keys->items().size() != refs.size()) {
    return DataLossError("storage key list of " + file + " has " + Num(keys->items().size()) +
                         " keys, the pickle references " + Num(refs.size()) + " storages");
  }
  for (const PyValue* k : keys->items()) {
    if (k->kind() != PyKind::kStr) return DataLossError("storage key in " + file + " not a str");
    auto it = refs.find(k->str());
    if (it == refs.end()) {
      return DataLossError("storage key '" + k->str() + "' in the list of " + file +
                           " is not referenced by the pickle");
    }
    if (storages.index.count(k->str())) {
      return DataLossError("storage key '" + k->str() + "' appears twice in " + file);
    }
    const StorageRef& s = it->second;
    std::string count_bytes;
    UCP_ASSIGN_OR_RETURN(count_bytes, source->ReadString(pos, 8),
                         "while reading the element count of storage '" + s.key + "'");
    int64_t count = 0;
    std::memcpy(&count, count_bytes.data(), 8);  // little-endian host, checked at build time
    if (count != s.numel) {
      return DataLossError("storage '" + s.key + "' in " + file + " has element count " +
                           Num(count) + " at offset " + Num(pos) + ", the pickle says " +
                           Num(s.numel));
    }
    pos += 8;
    if (s.num_bytes > size - pos) {
      return DataLossError("storage '" + s.key + "' of " + Num(s.num_bytes) + " bytes at offset " +
                           Num(pos) + " runs past the end of " + file + " (" + Num(size) +
                           " bytes)");
    }
    storages.index.emplace(s.key, storages.records.size());
    storages.records.push_back({s.key, pos, s.num_bytes, 0});
    pos += s.num_bytes;
  }
  if (pos != size) {
    return DataLossError("legacy torch file " + file + " has " + Num(size - pos) +
                         " trailing bytes after its last storage");
  }
  return Status::Ok();
}

Result<const StorageRecord*> TorchFile::Impl::Record(const StorageRef& s) const {
  auto it = storages.index.find(s.key);
  if (it == storages.index.end()) {
    return NotFoundError("storage '" + s.key + "' is not in " + source->name());
  }
  const StorageRecord& r = storages.records[it->second];
  if (r.num_bytes != s.num_bytes) {
    return DataLossError("storage '" + s.key + "' has " + Num(r.num_bytes) + " bytes in " +
                         source->name() + ", the tensor reference says " + Num(s.num_bytes));
  }
  return &r;
}

TorchFile::TorchFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TorchFile::TorchFile(TorchFile&&) noexcept = default;
TorchFile& TorchFile::operator=(TorchFile&&) noexcept = default;
TorchFile::~TorchFile() = default;

Result<TorchFile> TorchFile::Open(const std::filesystem::path& path,
                                  const TorchReadOptions& options) {
  UCP_ASSIGN_OR_RETURN(std::shared_ptr<const ByteSource> src, ByteSource::OpenFile(path));
  return OpenSource(std::move(src), options);
}

Result<TorchFile> TorchFile::OpenBuffer(std::span<const std::byte> bytes,
                                        const TorchReadOptions& options, std::string name) {
  return OpenSource(ByteSource::FromBuffer(bytes, std::move(name)), options);
}

Result<TorchFile> TorchFile::OpenSource(std::shared_ptr<const ByteSource> source,
                                        const TorchReadOptions& options) {
  static_assert(std::endian::native == std::endian::little, "ucp reads little-endian hosts only");
  auto impl = std::make_unique<Impl>();
  impl->source = std::move(source);
  impl->options = options;
  const std::string file = impl->source->name();
  const int64_t head_len = std::min<int64_t>(impl->source->size(), 15);
  UCP_ASSIGN_OR_RETURN(std::string head, impl->source->ReadString(0, head_len));
  if (head.starts_with("PK\x03\x04")) {
    impl->format = TorchFormat::kZip;
    UCP_RETURN_IF_ERROR(impl->OpenZip(), "while reading torch file " + file);
  } else if (IsLegacyMagic(head)) {
    impl->format = TorchFormat::kLegacy;
    UCP_RETURN_IF_ERROR(impl->OpenLegacy(), "while reading legacy torch file " + file);
  } else if (head.starts_with("PYTORCH1")) {
    return UnimplementedError(file + " is a preview-release torch archive (PYTORCH1)");
  } else {
    return DataLossError(file + " is not a torch.save file: it starts with neither a zip local " +
                         "header nor the legacy magic number (" + Num(impl->source->size()) +
                         " bytes)");
  }
  return TorchFile(std::move(impl));
}

TorchFormat TorchFile::format() const { return impl_->format; }
const std::string& TorchFile::name() const { return impl_->source->name(); }
Status TorchFile::CheckSourceUnchanged() const { return impl_->source->CheckUnchanged(); }
const PyValue& TorchFile::root() const { return *impl_->root; }
const std::vector<StorageRecord>& TorchFile::storages() const { return impl_->storages.records; }

namespace {

// The view's element range [first, last] within the storage, checked against its bytes.
Status CheckView(const TensorRef& ref, int64_t storage_bytes, int64_t* last_elem,
                 const std::string& file) {
  auto fault = [&](const std::string& why) {
    return DataLossError("tensor view of storage '" + ref.storage.key + "' in " + file +
                         " (offset " + Num(ref.storage_offset) + ", size " +
                         ShapeToString(ref.size) + ", stride " + ShapeToString(ref.stride) + ") " +
                         why);
  };
  if (ref.size.size() != ref.stride.size()) return fault("has mismatched size and stride");
  if (ref.storage_offset < 0) return fault("has a negative offset");
  auto numel = CheckedProduct(ref.size, "tensor size");
  if (!numel.ok()) return fault("has a bad size");
  int64_t last = ref.storage_offset;
  for (size_t k = 0; k < ref.size.size(); ++k) {
    if (ref.stride[k] < 0) return fault("has a negative stride");
    if (ref.size[k] == 0) continue;
    auto step = CheckedMul(ref.size[k] - 1, ref.stride[k]);
    auto sum = step ? CheckedAdd(last, *step) : std::nullopt;
    if (!sum) return fault("overflows int64");
    last = *sum;
  }
  *last_elem = *numel == 0 ? ref.storage_offset - 1 : last;
  if (*numel > 0) {
    auto end = CheckedAdd(last, 1);
    auto bytes = end ? CheckedMul(*end, DTypeSizeBytes(ref.dtype)) : std::nullopt;
    if (!bytes || *bytes > storage_bytes) {
      return fault("reaches past its " + Num(storage_bytes) + " bytes");
    }
  }
  return Status::Ok();
}

}  // namespace

void GatherStrided(std::span<const std::byte> storage, const TensorRef& ref,
                   std::span<std::byte> out) {
  const int64_t item = DTypeSizeBytes(ref.dtype);
  const int64_t numel = ref.num_elements();
  if (numel == 0) return;
  const size_t nd = ref.size.size();
  std::vector<int64_t> idx(nd, 0);
  int64_t src_elem = ref.storage_offset;
  std::byte* dst = out.data();
  const int64_t inner = nd == 0 ? 1 : ref.size[nd - 1];
  const int64_t inner_stride = nd == 0 ? 0 : ref.stride[nd - 1];
  for (int64_t done = 0; done < numel; done += inner) {
    const std::byte* src = storage.data();
    for (int64_t i = 0; i < inner; ++i) {
      std::memcpy(dst, src + (src_elem + i * inner_stride) * item, static_cast<size_t>(item));
      dst += item;
    }
    // Odometer over the outer dims.
    for (size_t k = nd >= 1 ? nd - 1 : 0; k-- > 0;) {
      if (++idx[k] < ref.size[k]) {
        src_elem += ref.stride[k];
        break;
      }
      src_elem -= (ref.size[k] - 1) * ref.stride[k];
      idx[k] = 0;
    }
  }
}

Result<Tensor> TorchFile::ReadTensor(const TensorRef& ref) const {
  UCP_ASSIGN_OR_RETURN(const StorageRecord* rec, impl_->Record(ref.storage));
  int64_t last = 0;
  UCP_RETURN_IF_ERROR(CheckView(ref, rec->num_bytes, &last, name()));
  UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(ref.dtype, ref.size));
  const int64_t item = DTypeSizeBytes(ref.dtype);
  if (t.num_bytes() == 0) return t;
  const int64_t first_byte = ref.storage_offset * item;
  const int64_t span_bytes = (last + 1) * item - first_byte;
  const bool whole = first_byte == 0 && span_bytes == rec->num_bytes;
  // Zip records carry a CRC (always checked, 0 included); legacy files have none.
  const bool check_crc =
      whole && impl_->options.verify_crc32 && impl_->format == TorchFormat::kZip;
  if (ref.IsContiguous() && span_bytes == t.num_bytes()) {
    UCP_RETURN_IF_ERROR(impl_->source->ReadAt(rec->data_offset + first_byte,
                                              std::span<std::byte>(t.data(), t.num_bytes())));
    UCP_RETURN_IF_ERROR(
        impl_->Observe(*rec, first_byte, std::span<const std::byte>(t.data(), t.num_bytes())));
    if (check_crc && Crc32(std::span<const std::byte>(t.data(), t.num_bytes())) != rec->crc32) {
      return DataLossError("crc32 mismatch in storage '" + rec->key + "' of " + name());
    }
    return t;
  }
  // Strided: read the touched extent once, then gather (offsets rebased to the extent).
  UCP_ASSIGN_OR_RETURN(HostBuffer extent, HostBuffer::Allocate(span_bytes));
  UCP_RETURN_IF_ERROR(impl_->source->ReadAt(rec->data_offset + first_byte, extent.bytes()));
  UCP_RETURN_IF_ERROR(impl_->Observe(*rec, first_byte, extent.bytes()));
  if (check_crc && Crc32(extent.bytes()) != rec->crc32) {
    return DataLossError("crc32 mismatch in storage '" + rec->key + "' of " + name());
  }
  TensorRef rebased = ref;
  rebased.storage_offset = 0;
  GatherStrided(extent.bytes(), rebased, std::span<std::byte>(t.data(), t.num_bytes()));
  return t;
}

Status TorchFile::ReadTensorBytes(const TensorRef& ref, int64_t byte_offset,
                                  std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(const StorageRecord* rec, impl_->Record(ref.storage));
  int64_t last = 0;
  UCP_RETURN_IF_ERROR(CheckView(ref, rec->num_bytes, &last, name()));
  if (!ref.IsContiguous()) {
    return FailedPreconditionError("tensor of storage '" + ref.storage.key + "' in " + name() +
                                   " is not contiguous (stride " + ShapeToString(ref.stride) +
                                   "), so it has no byte ranges");
  }
  const int64_t item = DTypeSizeBytes(ref.dtype);
  const int64_t total = ref.num_elements() * item;
  const int64_t n = static_cast<int64_t>(out.size());
  if (byte_offset < 0 || byte_offset > total || n > total - byte_offset) {
    return OutOfRangeError("byte range [" + Num(byte_offset) + ", " + Num(byte_offset + n) +
                           ") is outside the " + Num(total) + " bytes of the tensor of storage '" +
                           ref.storage.key + "' in " + name());
  }
  const int64_t at = ref.storage_offset * item + byte_offset;
  UCP_RETURN_IF_ERROR(impl_->source->ReadAt(rec->data_offset + at, out));
  return impl_->Observe(*rec, at, out);
}

namespace {
std::string CrcMismatch(const StorageRecord& rec, const std::string& file) {
  return "crc32 mismatch in record 'data/" + rec.key + "' of " + file + " (" + Num(rec.num_bytes) +
         " bytes)";
}
uint64_t CrcPiece(std::span<const std::byte> bytes, uint64_t seed) {
  return Crc32(bytes, static_cast<uint32_t>(seed));
}
uint64_t CrcCombine(uint64_t a, uint64_t b, int64_t len_b) {
  return Crc32Combine(static_cast<uint32_t>(a), static_cast<uint32_t>(b), len_b);
}
}  // namespace

void TorchFile::VerifyReads() {
  impl_->verifier.reset();
  if (impl_->format != TorchFormat::kZip || !impl_->options.verify_crc32) return;
  auto v = std::make_unique<io::ReadVerifier>();
  const std::shared_ptr<const ByteSource> source = impl_->source;
  for (const StorageRecord& rec : impl_->storages.records) {
    const int64_t base = rec.data_offset;
    v->AddCombinable(rec.num_bytes, rec.crc32, {&CrcPiece, &CrcCombine}, CrcMismatch(rec, name()),
                     [source, base](int64_t offset, std::span<std::byte> out) {
                       return source->ReadAt(base + offset, out);
                     });
  }
  impl_->verifier = std::move(v);
}

Status TorchFile::FinishVerifiedReads(const StorageRecord& storage) const {
  if (impl_->verifier == nullptr) return VerifyStorageCrc32(storage);
  auto it = impl_->storages.index.find(storage.key);
  if (it == impl_->storages.index.end()) {
    return NotFoundError("storage '" + storage.key + "' is not in " + name());
  }
  return impl_->verifier->Finish(static_cast<int32_t>(it->second));
}

Status TorchFile::VerifyReadsFailure() const {
  return impl_->verifier == nullptr ? Status::Ok() : impl_->verifier->FirstFailure();
}

int64_t TorchFile::verify_bytes_observed() const {
  return impl_->verifier == nullptr ? 0 : impl_->verifier->bytes_observed();
}
int64_t TorchFile::verify_bytes_reread() const {
  return impl_->verifier == nullptr ? 0 : impl_->verifier->bytes_reread();
}

Status TorchFile::VerifyStorageCrc32(const StorageRecord& rec) const {
  if (impl_->format != TorchFormat::kZip) return Status::Ok();
  constexpr int64_t kChunkBytes = int64_t{1} << 20;
  std::vector<std::byte> buf(static_cast<size_t>(std::min(kChunkBytes, rec.num_bytes)));
  uint32_t crc = 0;
  for (int64_t at = 0; at < rec.num_bytes; at += kChunkBytes) {
    const std::span<std::byte> chunk(
        buf.data(), static_cast<size_t>(std::min(kChunkBytes, rec.num_bytes - at)));
    UCP_RETURN_IF_ERROR(impl_->source->ReadAt(rec.data_offset + at, chunk));
    crc = Crc32(chunk, crc);
    progress::AddBytes(static_cast<int64_t>(chunk.size()));  // the checksum pass's progress
  }
  if (crc != rec.crc32) {
    return DataLossError(CrcMismatch(rec, name()));
  }
  return Status::Ok();
}

}  // namespace ucp::torch
