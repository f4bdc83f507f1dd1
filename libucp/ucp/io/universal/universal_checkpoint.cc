// Universal checkpoint writer and reader, on H5File and the manifest.
#include "ucp/io/universal/universal_checkpoint.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <unordered_map>

#include "ucp/base/checked_math.h"
#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/checksum.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/interrupt.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/read_verifier.h"
#include "ucp/io/safe_name.h"
#include "ucp/io/streamed_dataset.h"

namespace ucp::io {
namespace fs = std::filesystem;
namespace {

constexpr int64_t kMaxManifestBytes = int64_t{256} << 20;

// File attributes of a parameter file.
constexpr std::string_view kAttrName = "name";
constexpr std::string_view kAttrShape = "shape";
constexpr std::string_view kAttrStep = "step";

const UniversalStateInfo* FindState(const UniversalParamInfo& p, std::string_view state) {
  for (const auto& s : p.states) {
    if (s.name == state) return &s;
  }
  return nullptr;
}

}  // namespace

// ---- Writer -------------------------------------------------------------------------------

namespace {

// A parameter file being written: uncompressed states go straight to the file at their
// datasets' offsets; compressed ones are buffered and written, in declared order, when all are
// complete (so equal input gives equal bytes whatever order the states finish in).
struct OpenParam {
  UniversalParamInfo info;  // states filled with checksums when complete
  fs::path path;
  std::vector<StateDecl> decls;
  int64_t elems = 0;
  // Uncompressed.
  std::optional<RawFile> raw;
  std::vector<std::unique_ptr<StreamedDataset>> streams;
  // Compressed.
  std::optional<H5File> h5;
  std::vector<std::vector<std::byte>> buffers;
  std::vector<int64_t> filled;
  std::mutex mu;
  int remaining = 0;  // states not complete, guarded by mu
};

}  // namespace

struct UniversalWriter::Impl {
  fs::path dst;
  fs::path tmp;
  UniversalWriteOptions options;
  std::mutex mu;
  std::vector<UniversalParamInfo> written;                              // guarded by mu
  std::set<std::string> names;                                          // guarded by mu
  std::map<std::string, std::shared_ptr<OpenParam>, std::less<>> open;  // guarded by mu
  bool committed = false;                                               // guarded by mu

  bool joined() const { return !options.join_temp.empty(); }

  ~Impl() {
    if (!committed && !joined()) {
      open.clear();
      RemoveTreeBestEffort(tmp);
    }
    if (joined()) UnregisterTempPath(tmp);
  }

  Status Validate(const UniversalParamInfo& meta, const std::string& what) const {
    if (!NumElements(meta.shape).ok()) {
      return InvalidArgumentError(what + " has an invalid shape " + ShapeToString(meta.shape));
    }
    return ValidateJsonObject(meta.pattern_json, "pattern_json of " + what);
  }

  // Closes a parameter whose states are all complete and records it.
  Status Finish(OpenParam& p) {
    if (p.raw) {
      if (joined()) {
        // The committing process may be on another machine: this one makes its files durable.
        UCP_RETURN_IF_ERROR(p.raw->Sync());
      } else {
        // Writeback starts now; Commit's fsync of the folder waits for it.
        UCP_RETURN_IF_ERROR(p.raw->StartWriteback());
      }
      UCP_RETURN_IF_ERROR(p.raw->Close());
      for (size_t i = 0; i < p.decls.size(); ++i) {
        p.info.states.push_back({p.decls[i].name, p.decls[i].dtype, p.streams[i]->checksum()});
      }
    } else {
      for (size_t i = 0; i < p.decls.size(); ++i) {
        ConstTensorView view{p.decls[i].dtype, p.info.shape, p.buffers[i]};
        UCP_RETURN_IF_ERROR(p.h5->WriteDataset(
            p.decls[i].name, view,
            {.compression_level = options.compression_level, .chunk_bytes = options.chunk_bytes}));
        p.info.states.push_back(
            {p.decls[i].name, p.decls[i].dtype, FormatXxh3(Xxh3_64(p.buffers[i]))});
        std::vector<std::byte>().swap(p.buffers[i]);
      }
      UCP_RETURN_IF_ERROR(p.h5->Close());
      p.h5.reset();
      if (joined()) UCP_RETURN_IF_ERROR(FsyncPath(p.path));
    }
    std::lock_guard<std::mutex> lock(mu);
    written.push_back(p.info);
    open.erase(p.info.name);
    return Status::Ok();
  }
};

UniversalWriter::UniversalWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UniversalWriter::UniversalWriter(UniversalWriter&&) noexcept = default;
UniversalWriter& UniversalWriter::operator=(UniversalWriter&&) noexcept = default;
UniversalWriter::~UniversalWriter() = default;
const fs::path& UniversalWriter::temp_dir() const { return impl_->tmp; }

Result<UniversalWriter> UniversalWriter::Create(const fs::path& dst_in,
                                                const UniversalWriteOptions& options) {
  // "out/" names the folder "out" (whose parent is ".", not "out" itself).
  const fs::path dst = WithoutTrailingSlash(dst_in);
  std::error_code ec;
  if (dst.empty()) return InvalidArgumentError("universal checkpoint path is empty");
  if (fs::exists(fs::symlink_status(dst, ec))) {
    return AlreadyExistsError("universal checkpoint " + dst.string() +
                              " already exists; ucp never overwrites");
  }
  if (IsTempName(dst.filename().string())) {
    return InvalidArgumentError("universal checkpoint name " + dst.filename().string() +
                                " contains '.tmp-', which marks unfinished writes");
  }
  if (options.chunk_bytes < 4096 || options.chunk_bytes > (int64_t{1} << 30)) {
    return InvalidArgumentError("chunk_bytes " + std::to_string(options.chunk_bytes) +
                                " is outside [4096, 1073741824]");
  }
  const fs::path parent = dst.parent_path();
  if (!parent.empty()) {
    fs::create_directories(parent, ec);
    if (ec) return ErrnoError("create folder " + parent.string(), ec.value());
  }
  auto impl = std::make_unique<Impl>();
  impl->dst = dst;
  impl->options = options;
  if (!options.join_temp.empty()) {
    if (!fs::is_directory(options.join_temp / "params", ec)) {
      return NotFoundError("temporary folder " + options.join_temp.string() +
                           " to join has no params/ folder");
    }
    impl->tmp = options.join_temp;
    // Whichever process a signal reaches first removes the shared folder (io/interrupt.h).
    RegisterTempPath(impl->tmp);
    return UniversalWriter(std::move(impl));
  }
  UCP_ASSIGN_OR_RETURN(impl->tmp, MakeTempSiblingDir(dst));
  fs::create_directory(impl->tmp / "params", ec);
  if (ec) return ErrnoError("create folder " + (impl->tmp / "params").string(), ec.value());
  return UniversalWriter(std::move(impl));
}

Status UniversalWriter::BeginParameter(const UniversalParamInfo& meta,
                                       std::span<const StateDecl> states) {
  const std::string what = "parameter '" + meta.name + "'";
  UCP_ASSIGN_OR_RETURN(std::string rel, ParamFileName(meta.name));
  if (states.empty()) return InvalidArgumentError(what + " has no states to write");
  UCP_RETURN_IF_ERROR(impl_->Validate(meta, what));
  std::set<std::string> seen;
  for (const StateDecl& d : states) {
    if (d.name.empty()) return InvalidArgumentError(what + " has a state with an empty name");
    if (!seen.insert(d.name).second) {
      return InvalidArgumentError(what + " has state '" + d.name + "' twice");
    }
    if (d.name.find('/') != std::string::npos) {
      return InvalidArgumentError(what + " state name '" + d.name + "' contains '/'");
    }
  }
  auto p = std::make_shared<OpenParam>();
  p->info = meta;
  p->info.file = rel;
  p->info.states.clear();
  p->path = impl_->tmp / rel;
  p->decls.assign(states.begin(), states.end());
  p->elems = NumElementsOrDie(meta.shape);
  p->remaining = static_cast<int>(states.size());
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->committed) return FailedPreconditionError("cannot write " + what + " after Commit");
    if (!impl_->names.insert(meta.name).second) {
      return AlreadyExistsError(what + " was already written to " + impl_->tmp.string());
    }
  }
  Status st = [&]() -> Status {
    UCP_ASSIGN_OR_RETURN(H5File f, H5File::Create(p->path));
    UCP_RETURN_IF_ERROR(f.WriteStringAttribute("", kAttrName, meta.name));
    UCP_RETURN_IF_ERROR(f.WriteInt64ArrayAttribute("", kAttrShape, meta.shape));
    UCP_RETURN_IF_ERROR(f.WriteInt64Attribute("", kAttrStep, impl_->options.step));
    const bool compress =
        impl_->options.compression_level != 0 && p->elems > 0 && !meta.shape.empty();
    if (compress) {
      p->h5.emplace(std::move(f));
      p->buffers.resize(states.size());
      p->filled.assign(states.size(), 0);
      for (size_t i = 0; i < states.size(); ++i) {
        p->buffers[i].resize(static_cast<size_t>(p->elems * DTypeSizeBytes(states[i].dtype)));
      }
      return Status::Ok();
    }
    for (const StateDecl& d : states) {
      UCP_ASSIGN_OR_RETURN(int64_t offset, f.CreateDirectDataset(d.name, d.dtype, meta.shape));
      p->streams.push_back(
          std::make_unique<StreamedDataset>(what + " state '" + d.name + "' in " + p->path.string(),
                                            offset, p->elems, DTypeSizeBytes(d.dtype)));
    }
    UCP_RETURN_IF_ERROR(f.Close());
    UCP_ASSIGN_OR_RETURN(RawFile raw, RawFile::OpenForWrite(p->path));
    p->raw.emplace(std::move(raw));
    return Status::Ok();
  }();
  if (!st.ok()) {
    std::error_code ec;
    fs::remove(p->path, ec);
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->names.erase(meta.name);
    return std::move(st).WithContext("while writing " + what + " to " + p->path.string());
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->open.emplace(meta.name, p);
  }
  if (p->elems == 0) {
    // Nothing will arrive for empty states: they are complete now.
    for (const StateDecl& d : states) {
      UCP_RETURN_IF_ERROR(WriteStateRange(meta.name, d.name, 0, {}));
    }
  }
  return Status::Ok();
}

Status UniversalWriter::WriteStateRange(std::string_view param, std::string_view state,
                                        int64_t begin_elem, std::span<const std::byte> data) {
  std::shared_ptr<OpenParam> p;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->open.find(param);
    if (it == impl_->open.end()) {
      return NotFoundError("parameter '" + std::string(param) + "' was not begun, or is complete");
    }
    p = it->second;
  }
  size_t i = 0;
  while (i < p->decls.size() && p->decls[i].name != state) ++i;
  if (i == p->decls.size()) {
    return NotFoundError("parameter '" + p->info.name + "' has no state '" + std::string(state) +
                         "'");
  }
  bool complete = false;
  if (p->raw) {
    UCP_RETURN_IF_ERROR(p->streams[i]->Append(*p->raw, begin_elem, data));
    complete = p->streams[i]->complete();
  } else {
    std::lock_guard<std::mutex> lock(p->mu);
    const int64_t size = DTypeSizeBytes(p->decls[i].dtype);
    const int64_t n = static_cast<int64_t>(data.size()) / size;
    if (begin_elem != p->filled[i] || n * size != static_cast<int64_t>(data.size()) ||
        n > p->elems - begin_elem) {
      return InvalidArgumentError("parameter '" + p->info.name + "' state '" + std::string(state) +
                                  "': range [" + std::to_string(begin_elem) + ", +" +
                                  std::to_string(data.size()) + " bytes) does not continue at " +
                                  std::to_string(p->filled[i]) + " of " + std::to_string(p->elems) +
                                  " elements");
    }
    if (!data.empty())
      std::memcpy(p->buffers[i].data() + begin_elem * size, data.data(), data.size());
    p->filled[i] += n;
    complete = p->filled[i] == p->elems;
  }
  if (!complete) return Status::Ok();
  {
    std::lock_guard<std::mutex> lock(p->mu);
    if (--p->remaining > 0) return Status::Ok();
  }
  return impl_->Finish(*p);
}

Status UniversalWriter::WriteParameter(const UniversalParamInfo& meta,
                                       std::span<const NamedState> states) {
  const std::string what = "parameter '" + meta.name + "'";
  std::vector<StateDecl> decls;
  for (const auto& [name, view] : states) {
    if (view.shape != meta.shape) {
      return InvalidArgumentError(
          what + " state '" + name + "' has shape " + ShapeToString(view.shape) +
          " but the parameter's logical shape is " + ShapeToString(meta.shape));
    }
    UCP_RETURN_IF_ERROR(ValidateView(view, what + " state '" + name + "'"));
    decls.push_back({name, view.dtype});
  }
  UCP_RETURN_IF_ERROR(BeginParameter(meta, decls));
  if (NumElementsOrDie(meta.shape) == 0) return Status::Ok();
  for (const auto& [name, view] : states) {
    UCP_RETURN_IF_ERROR(WriteStateRange(meta.name, name, 0, view.bytes));
  }
  return Status::Ok();
}

Result<std::string> UniversalWriter::LocalPart() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (!impl_->open.empty()) {
    return FailedPreconditionError("parameter '" + impl_->open.begin()->first +
                                   "' was begun but not every state was written");
  }
  // A manifest holding only the parameters: the strict parser checks it at the other end.
  UniversalManifest part;
  part.step = impl_->options.step;
  part.params = impl_->written;
  std::sort(part.params.begin(), part.params.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return SerializeUniversalManifest(part);
}

Status UniversalWriter::AddPart(std::string_view part) {
  UCP_ASSIGN_OR_RETURN(UniversalManifest m,
                       ParseUniversalManifest(part, "part from another process"));
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (UniversalParamInfo& p : m.params) {
    if (!impl_->names.insert(p.name).second) {
      return AlreadyExistsError("parameter '" + p.name + "' was written by two processes");
    }
    impl_->written.push_back(std::move(p));
  }
  return Status::Ok();
}

Status UniversalWriter::Commit(const UniversalManifest& header) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->joined()) {
    return FailedPreconditionError("a writer that joined another process's folder cannot commit");
  }
  if (impl_->committed)
    return FailedPreconditionError("universal checkpoint was already committed");
  if (!header.params.empty()) {
    return InvalidArgumentError("header.params must be empty: Commit fills it from the " +
                                std::to_string(impl_->written.size()) + " written parameters");
  }
  if (header.step != impl_->options.step) {
    return InvalidArgumentError("header.step " + std::to_string(header.step) +
                                " differs from the step " + std::to_string(impl_->options.step) +
                                " written into the parameter files");
  }
  if (!impl_->open.empty()) {
    return FailedPreconditionError("parameter '" + impl_->open.begin()->first +
                                   "' was begun but not every state was written");
  }
  UniversalManifest m = header;
  m.params = impl_->written;
  std::sort(m.params.begin(), m.params.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  UCP_ASSIGN_OR_RETURN(std::string text, SerializeUniversalManifest(m));
  UCP_RETURN_IF_ERROR(FsyncTree(impl_->tmp));
  UCP_RETURN_IF_ERROR(WriteFileAtomic(impl_->tmp / kManifestFileName, text));
  UCP_RETURN_IF_ERROR(RenameNoReplace(impl_->tmp, impl_->dst));
  impl_->committed = true;
  return Status::Ok();
}

// ---- Reader -------------------------------------------------------------------------------

namespace {

// Where one parameter's states are, found once per parameter: each state's byte offset in the
// file (-1: read through HDF5, e.g. compressed).
struct ParamLayout {
  std::once_flag once;
  Status status;
  std::vector<int64_t> offsets;      // per manifest state
  std::vector<Status> state_status;  // per manifest state: dtype, shape, extent checks
};

}  // namespace

struct UniversalReader::Impl {
  fs::path dir;
  UniversalManifest manifest;
  std::unordered_map<std::string, size_t> by_name;
  std::unique_ptr<ParamLayout[]> layouts;
  mutable RawFileCache files;
  // VerifyReads (issue 14): one XXH3 record per (parameter, state), record_base[pi] + si; or
  // null.
  mutable std::unique_ptr<ReadVerifier> verifier;
  mutable std::vector<int32_t> record_base;

  Status Err(const UniversalParamInfo& p, std::string_view state, const std::string& msg) const {
    return DataLossError("file " + (dir / p.file).string() + ", parameter '" + p.name + "'" +
                         (state.empty() ? std::string() : ", state '" + std::string(state) + "'") +
                         ": " + msg);
  }

  Result<size_t> FindParam(std::string_view param) const {
    auto it = by_name.find(std::string(param));
    if (it == by_name.end()) {
      return NotFoundError("parameter '" + std::string(param) + "' is not in " + dir.string());
    }
    return it->second;
  }

  Result<std::pair<size_t, size_t>> Find(std::string_view param, std::string_view state) const {
    UCP_ASSIGN_OR_RETURN(size_t pi, FindParam(param));
    const UniversalParamInfo& p = manifest.params[pi];
    for (size_t si = 0; si < p.states.size(); ++si) {
      if (p.states[si].name == state) return std::make_pair(pi, si);
    }
    return NotFoundError("parameter '" + p.name + "' has no state '" + std::string(state) +
                         "' in the manifest of " + dir.string());
  }

  Result<H5File> OpenFile(const UniversalParamInfo& p) const {
    // Seen before HDF5 reads it, so that a change from here to the commit is caught.
    Status noted = files.Note(dir / p.file);
    if (!noted.ok() && noted.code() != StatusCode::kNotFound) return noted;
    auto f = H5File::Open(dir / p.file);
    if (!f.ok()) {
      // A limit (too many open files) or an OS error is not corruption (issue 16 #4).
      const StatusCode code = f.status().code();
      return Status(code == StatusCode::kResourceExhausted || code == StatusCode::kIoError
                        ? code
                        : StatusCode::kDataLoss,
                    "parameter '" + p.name + "' field file: " + f.status().message());
    }
    return f;
  }

  // Checks the dataset's dtype and shape against the manifest.
  Status CheckMeta(const H5File& f, const UniversalParamInfo& p,
                   const UniversalStateInfo& s) const {
    auto meta = f.DatasetInfo(s.name);
    if (!meta.ok()) {
      if (meta.status().code() == StatusCode::kNotFound) {
        return Err(p, s.name, "state dataset is missing from the file");
      }
      return Err(p, s.name, meta.status().message());
    }
    if (meta->dtype != s.dtype) {
      return Err(p, s.name,
                 "field dtype: manifest says " + std::string(DTypeName(s.dtype)) +
                     " but the dataset holds " + std::string(DTypeName(meta->dtype)));
    }
    if (meta->shape != p.shape) {
      return Err(p, s.name,
                 "field shape: manifest says " + ShapeToString(p.shape) + " but the dataset is " +
                     ShapeToString(meta->shape));
    }
    return Status::Ok();
  }

  // The offsets of parameter `pi`'s states, checking each state's dtype and shape and that its
  // bytes are in the file, once. A problem with one state is reported when that state is used.
  Result<const ParamLayout*> Layout(size_t pi) const {
    ParamLayout& l = layouts[pi];
    std::call_once(l.once, [&] {
      const UniversalParamInfo& p = manifest.params[pi];
      l.status = [&]() -> Status {
        UCP_ASSIGN_OR_RETURN(H5File f, OpenFile(p));
        for (const UniversalStateInfo& s : p.states) {
          l.offsets.push_back(-1);
          l.state_status.push_back([&]() -> Status {
            UCP_RETURN_IF_ERROR(CheckMeta(f, p, s));
            Result<int64_t> off = f.DirectOffset(s.name);
            if (!off.ok()) return Err(p, s.name, off.status().message());
            l.offsets.back() = *off;
            return Status::Ok();
          }());
        }
        return Status::Ok();
      }();
    });
    if (!l.status.ok()) return l.status;
    return &l;
  }

  // The byte offset of state si of parameter pi (-1: through HDF5), once checked.
  Result<int64_t> OffsetOf(size_t pi, size_t si) const {
    UCP_ASSIGN_OR_RETURN(const ParamLayout* l, Layout(pi));
    UCP_RETURN_IF_ERROR(l->state_status[si]);
    return l->offsets[si];
  }

  // Reads a whole state into `out` (whose size matches) and checks its checksum.
  Status ReadInto(size_t pi, size_t si, TensorView out) const {
    const UniversalParamInfo& p = manifest.params[pi];
    const UniversalStateInfo& s = p.states[si];
    UCP_ASSIGN_OR_RETURN(int64_t offset, OffsetOf(pi, si));
    if (offset >= 0) {
      UCP_ASSIGN_OR_RETURN(std::shared_ptr<const RawFile> raw, files.Get(dir / p.file));
      Status st = raw->ReadAt(offset, out.bytes);
      if (!st.ok()) return Err(p, s.name, st.message());
    } else if (!out.bytes.empty()) {
      UCP_ASSIGN_OR_RETURN(H5File f, OpenFile(p));
      Status st = f.ReadDatasetInto(s.name, out);
      if (!st.ok()) return Err(p, s.name, st.message());
    }
    progress::AddBytes(static_cast<int64_t>(out.bytes.size()));
    return CheckSum(p, s, Xxh3_64(out.bytes));
  }

  // The parameter file's attributes (name, shape, step) and datasets against the manifest.
  Status CheckAttributes(const UniversalParamInfo& p, const H5File& f) const {
    auto name = f.ReadStringAttribute("", kAttrName);
    if (!name.ok()) return Err(p, "", "attribute name: " + name.status().message());
    if (*name != p.name) {
      return Err(p, "", "attribute name is '" + *name + "', not the parameter's name");
    }
    auto shape = f.ReadInt64ArrayAttribute("", kAttrShape);
    if (!shape.ok()) return Err(p, "", "attribute shape: " + shape.status().message());
    if (*shape != p.shape) {
      return Err(p, "",
                 "attribute shape is " + ShapeToString(*shape) + " but the manifest says " +
                     ShapeToString(p.shape));
    }
    auto step = f.ReadInt64Attribute("", kAttrStep);
    if (!step.ok()) return Err(p, "", "attribute step: " + step.status().message());
    if (*step != manifest.step) {
      return Err(p, "",
                 "attribute step is " + std::to_string(*step) + " but the manifest says " +
                     std::to_string(manifest.step));
    }
    UCP_ASSIGN_OR_RETURN(auto datasets, f.ListDatasets(), "while verifying " + f.path().string());
    for (const auto& d : datasets) {
      if (FindState(p, d) == nullptr) {
        return Err(p, d, "dataset is in the file but not in the manifest's states");
      }
    }
    return Status::Ok();
  }

  // Elements of state si of parameter pi as bytes [offset, offset + out.size()) of its
  // little-endian contents (whole elements), from the file or through HDF5.
  Status ReadStateBytes(size_t pi, size_t si, int64_t offset, std::span<std::byte> out) const {
    const UniversalParamInfo& p = manifest.params[pi];
    const UniversalStateInfo& s = p.states[si];
    UCP_ASSIGN_OR_RETURN(int64_t at, OffsetOf(pi, si));
    if (at >= 0) {
      UCP_ASSIGN_OR_RETURN(std::shared_ptr<const RawFile> raw, files.Get(dir / p.file));
      Status st = raw->ReadAt(at + offset, out);
      return st.ok() ? st : Err(p, s.name, st.message());
    }
    const int64_t size = DTypeSizeBytes(s.dtype);
    UCP_ASSIGN_OR_RETURN(H5File f, OpenFile(p));
    return f.ReadFlatRange(s.name, offset / size,
                           (offset + static_cast<int64_t>(out.size())) / size, out);
  }

  Status Observe(size_t pi, size_t si, int64_t byte_offset, std::span<const std::byte> b) const {
    if (verifier == nullptr) return Status::Ok();
    return verifier->Observe(record_base[pi] + static_cast<int32_t>(si), byte_offset, b);
  }

  Status CheckSum(const UniversalParamInfo& p, const UniversalStateInfo& s, uint64_t got) const {
    const uint64_t want = *ParseXxh3(s.checksum, "checksum");  // validated by the parser
    if (got != want) {
      return Err(p, s.name,
                 "field checksum: manifest says " + s.checksum + " but the data hashes to " +
                     FormatXxh3(got));
    }
    return Status::Ok();
  }
};

UniversalReader::UniversalReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UniversalReader::UniversalReader(UniversalReader&&) noexcept = default;
UniversalReader& UniversalReader::operator=(UniversalReader&&) noexcept = default;
UniversalReader::~UniversalReader() = default;
const UniversalManifest& UniversalReader::manifest() const { return impl_->manifest; }
const fs::path& UniversalReader::dir() const { return impl_->dir; }
Status UniversalReader::CheckSourcesUnchanged() const { return impl_->files.CheckUnchanged(); }

Result<UniversalReader> UniversalReader::Open(const fs::path& dir) {
  std::error_code ec;
  fs::path clean = dir.filename().empty() ? dir.parent_path() : dir;
  if (IsTempName(clean.filename().string())) {
    return FailedPreconditionError(
        dir.string() + " is the temporary folder of an unfinished write, not a checkpoint");
  }
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError("universal checkpoint folder " + dir.string() + " does not exist");
  }
  const fs::path manifest_path = dir / kManifestFileName;
  if (!fs::exists(manifest_path, ec)) {
    return NotFoundError(dir.string() + " has no " + std::string(kManifestFileName) +
                         ": not a complete universal checkpoint");
  }
  UCP_ASSIGN_OR_RETURN(std::string text, ReadFileToString(manifest_path, kMaxManifestBytes));
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  UCP_ASSIGN_OR_RETURN(impl->manifest, ParseUniversalManifest(text, manifest_path.string()));
  for (size_t i = 0; i < impl->manifest.params.size(); ++i) {
    const auto& p = impl->manifest.params[i];
    auto full = ResolveInside(dir, p.file, "field file");
    if (!full.ok()) {
      return DataLossError(manifest_path.string() + ": parameter '" + p.name + "' " +
                           full.status().message());
    }
    if (!fs::is_regular_file(*full, ec)) {
      return DataLossError(manifest_path.string() + ": parameter '" + p.name + "' field file '" +
                           p.file + "' does not exist");
    }
    impl->by_name.emplace(p.name, i);
  }
  impl->layouts = std::make_unique<ParamLayout[]>(impl->manifest.params.size());
  return UniversalReader(std::move(impl));
}

Result<const UniversalParamInfo*> UniversalReader::FindParam(std::string_view param) const {
  UCP_ASSIGN_OR_RETURN(size_t pi, impl_->FindParam(param));
  return &impl_->manifest.params[pi];
}

Result<Tensor> UniversalReader::ReadState(std::string_view param, std::string_view state) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  const UniversalParamInfo& p = impl_->manifest.params[ps.first];
  UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Uninitialized(p.states[ps.second].dtype, p.shape));
  UCP_RETURN_IF_ERROR(impl_->ReadInto(ps.first, ps.second, t.view()));
  return t;
}

Status UniversalReader::ReadStateInto(std::string_view param, std::string_view state,
                                      TensorView out) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  const UniversalParamInfo& p = impl_->manifest.params[ps.first];
  const UniversalStateInfo& s = p.states[ps.second];
  if (out.dtype != s.dtype || out.shape != p.shape) {
    return InvalidArgumentError("output for parameter '" + p.name + "' state '" +
                                std::string(state) + "' is " + std::string(DTypeName(out.dtype)) +
                                " " + ShapeToString(out.shape) + " but the checkpoint holds " +
                                std::string(DTypeName(s.dtype)) + " " + ShapeToString(p.shape));
  }
  UCP_RETURN_IF_ERROR(ValidateView(out, "output for parameter '" + p.name + "'"));
  return impl_->ReadInto(ps.first, ps.second, out);
}

Status UniversalReader::ReadStateFlatRange(std::string_view param, std::string_view state,
                                           int64_t begin_elem, int64_t end_elem,
                                           std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  const UniversalParamInfo& p = impl_->manifest.params[ps.first];
  const UniversalStateInfo& s = p.states[ps.second];
  UCP_ASSIGN_OR_RETURN(int64_t offset, impl_->OffsetOf(ps.first, ps.second));
  const int64_t n = NumElementsOrDie(p.shape);
  const int64_t size = DTypeSizeBytes(s.dtype);
  if (begin_elem < 0 || end_elem < begin_elem || end_elem > n) {
    return OutOfRangeError("element range [" + std::to_string(begin_elem) + ", " +
                           std::to_string(end_elem) + ") is outside parameter '" + p.name +
                           "' state '" + s.name + "' of " + std::to_string(n) + " elements");
  }
  if (static_cast<int64_t>(out.size()) != (end_elem - begin_elem) * size) {
    return InvalidArgumentError(
        "output for range [" + std::to_string(begin_elem) + ", " + std::to_string(end_elem) +
        ") of parameter '" + p.name + "' state '" + s.name + "' is " + std::to_string(out.size()) +
        " bytes, expected " + std::to_string((end_elem - begin_elem) * size));
  }
  if (out.empty()) return Status::Ok();
  if (offset >= 0) {
    UCP_ASSIGN_OR_RETURN(std::shared_ptr<const RawFile> raw, impl_->files.Get(impl_->dir / p.file));
    Status st = raw->ReadAt(offset + begin_elem * size, out);
    if (!st.ok()) return impl_->Err(p, s.name, st.message());
  } else {
    UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(p));
    UCP_RETURN_IF_ERROR(f.ReadFlatRange(s.name, begin_elem, end_elem, out));
  }
  return impl_->Observe(ps.first, ps.second, begin_elem * size, out);
}

void UniversalReader::VerifyReads() const {
  auto v = std::make_unique<ReadVerifier>();
  impl_->record_base.clear();
  for (size_t pi = 0; pi < impl_->manifest.params.size(); ++pi) {
    const UniversalParamInfo& p = impl_->manifest.params[pi];
    impl_->record_base.push_back(v->num_records());
    const int64_t n = NumElementsOrDie(p.shape);
    for (size_t si = 0; si < p.states.size(); ++si) {
      const UniversalStateInfo& s = p.states[si];
      const uint64_t want = *ParseXxh3(s.checksum, "checksum");  // validated by the parser
      const Impl* impl = impl_.get();
      v->AddXxh3(n * DTypeSizeBytes(s.dtype), want,
                 "file " + (impl_->dir / p.file).string() + ", parameter '" + p.name +
                     "', state '" + s.name + "': field checksum: the data does not hash to the "
                     "manifest's " + s.checksum,
                 [impl, pi, si](int64_t offset, std::span<std::byte> out) {
                   return impl->ReadStateBytes(pi, si, offset, out);
                 });
    }
  }
  impl_->verifier = std::move(v);
}

Status UniversalReader::FinishVerifiedReads(int part, int parts) const {
  if (impl_->verifier == nullptr) return Verify(part, parts);
  UCP_RETURN_IF_ERROR(impl_->verifier->FirstFailure());
  std::vector<Status> results(impl_->manifest.params.size());
  tbb::parallel_for(size_t{0}, impl_->manifest.params.size(), [&](size_t pi) {
    if (static_cast<int>(pi % parts) != part) return;
    const UniversalParamInfo& p = impl_->manifest.params[pi];
    results[pi] = [&]() -> Status {
      {
        UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(p));
        UCP_RETURN_IF_ERROR(impl_->CheckAttributes(p, f));
      }
      for (size_t si = 0; si < p.states.size(); ++si) {
        UCP_RETURN_IF_ERROR(impl_->OffsetOf(pi, si).status());
        UCP_RETURN_IF_ERROR(
            impl_->verifier->Finish(impl_->record_base[pi] + static_cast<int32_t>(si)));
      }
      return Status::Ok();
    }();
  });
  for (Status& st : results) UCP_RETURN_IF_ERROR(st);
  return Status::Ok();
}

int64_t UniversalReader::verify_bytes_reread() const {
  return impl_->verifier == nullptr ? 0 : impl_->verifier->bytes_reread();
}

Status UniversalReader::Verify(int part, int parts) const {
  // Parameters are checked in parallel; each state is hashed in bounded pieces straight from its
  // file (compressed states are read whole through HDF5).
  std::vector<Status> results(impl_->manifest.params.size());
  tbb::parallel_for(size_t{0}, impl_->manifest.params.size(), [&](size_t pi) {
    if (static_cast<int>(pi % parts) != part) return;
    const UniversalParamInfo& p = impl_->manifest.params[pi];
    results[pi] = [&]() -> Status {
      {
        UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(p));
        UCP_RETURN_IF_ERROR(impl_->CheckAttributes(p, f));
      }
      UCP_ASSIGN_OR_RETURN(int64_t n, NumElements(p.shape, "parameter '" + p.name + "'"));
      for (size_t si = 0; si < p.states.size(); ++si) {
        const UniversalStateInfo& s = p.states[si];
        auto checked_bytes = CheckedMul(n, DTypeSizeBytes(s.dtype));
        if (!checked_bytes) return impl_->Err(p, s.name, "field shape: byte count overflows int64");
        UCP_ASSIGN_OR_RETURN(int64_t offset, impl_->OffsetOf(pi, si));
        if (offset >= 0) {
          UCP_ASSIGN_OR_RETURN(std::shared_ptr<const RawFile> raw,
                               impl_->files.Get(impl_->dir / p.file));
          Result<uint64_t> h = HashFileRange(*raw, offset, *checked_bytes);
          if (!h.ok()) return impl_->Err(p, s.name, h.status().message());
          UCP_RETURN_IF_ERROR(impl_->CheckSum(p, s, *h));
        } else {
          UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Uninitialized(s.dtype, p.shape));
          UCP_RETURN_IF_ERROR(impl_->ReadInto(pi, si, t.view()));
        }
      }
      return Status::Ok();
    }();
  });
  for (Status& st : results) UCP_RETURN_IF_ERROR(st);
  return Status::Ok();
}

}  // namespace ucp::io
