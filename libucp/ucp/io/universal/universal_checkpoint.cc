// Universal checkpoint writer and reader, on H5File and the manifest.
#include "ucp/io/universal/universal_checkpoint.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <system_error>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/checksum.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/safe_name.h"

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

struct UniversalWriter::Impl {
  fs::path dst;
  fs::path tmp;
  UniversalWriteOptions options;
  std::mutex mu;
  std::vector<UniversalParamInfo> written;  // guarded by mu
  std::set<std::string> names;              // guarded by mu
  bool committed = false;                   // guarded by mu

  ~Impl() {
    if (!committed) RemoveTreeBestEffort(tmp);
  }
};

UniversalWriter::UniversalWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UniversalWriter::UniversalWriter(UniversalWriter&&) noexcept = default;
UniversalWriter& UniversalWriter::operator=(UniversalWriter&&) noexcept = default;
UniversalWriter::~UniversalWriter() = default;
const fs::path& UniversalWriter::temp_dir() const { return impl_->tmp; }

Result<UniversalWriter> UniversalWriter::Create(const fs::path& dst,
                                                const UniversalWriteOptions& options) {
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
  UCP_ASSIGN_OR_RETURN(impl->tmp, MakeTempSiblingDir(dst));
  fs::create_directory(impl->tmp / "params", ec);
  if (ec) return ErrnoError("create folder " + (impl->tmp / "params").string(), ec.value());
  return UniversalWriter(std::move(impl));
}

Status UniversalWriter::WriteParameter(const UniversalParamInfo& meta,
                                       std::span<const NamedState> states) {
  const std::string what = "parameter '" + meta.name + "'";
  UCP_ASSIGN_OR_RETURN(std::string rel, ParamFileName(meta.name));
  if (states.empty()) return InvalidArgumentError(what + " has no states to write");
  UCP_RETURN_IF_ERROR(ValidateJsonObject(meta.pattern_json, "pattern_json of " + what));
  if (!NumElements(meta.shape).ok()) {
    return InvalidArgumentError(what + " has an invalid shape " + ShapeToString(meta.shape));
  }
  std::set<std::string> seen;
  for (const auto& [name, view] : states) {
    if (name.empty()) return InvalidArgumentError(what + " has a state with an empty name");
    if (!seen.insert(name).second)
      return InvalidArgumentError(what + " has state '" + name + "' twice");
    if (name.find('/') != std::string::npos) {
      return InvalidArgumentError(what + " state name '" + name + "' contains '/'");
    }
    if (view.shape != meta.shape) {
      return InvalidArgumentError(
          what + " state '" + name + "' has shape " + ShapeToString(view.shape) +
          " but the parameter's logical shape is " + ShapeToString(meta.shape));
    }
    UCP_RETURN_IF_ERROR(ValidateView(view, what + " state '" + name + "'"));
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->committed) return FailedPreconditionError("cannot write " + what + " after Commit");
    if (!impl_->names.insert(meta.name).second) {
      return AlreadyExistsError(what + " was already written to " + impl_->tmp.string());
    }
  }
  UniversalParamInfo info = meta;
  info.file = rel;
  info.states.clear();
  const fs::path path = impl_->tmp / rel;
  Status st = [&]() -> Status {
    UCP_ASSIGN_OR_RETURN(H5File f, H5File::Create(path));
    UCP_RETURN_IF_ERROR(f.WriteStringAttribute("", kAttrName, meta.name));
    UCP_RETURN_IF_ERROR(f.WriteInt64ArrayAttribute("", kAttrShape, meta.shape));
    UCP_RETURN_IF_ERROR(f.WriteInt64Attribute("", kAttrStep, impl_->options.step));
    for (const auto& [name, view] : states) {
      UCP_RETURN_IF_ERROR(f.WriteDataset(name, view,
                                         {.compression_level = impl_->options.compression_level,
                                          .chunk_bytes = impl_->options.chunk_bytes}));
      info.states.push_back({name, view.dtype, FormatXxh3(Xxh3_64(view.bytes))});
    }
    UCP_RETURN_IF_ERROR(f.Close());
    return FsyncPath(path);
  }();
  if (!st.ok()) {
    std::error_code ec;
    fs::remove(path, ec);
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->names.erase(meta.name);
    return std::move(st).WithContext("while writing " + what + " to " + path.string());
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->written.push_back(std::move(info));
  return Status::Ok();
}

Status UniversalWriter::Commit(const UniversalManifest& header) {
  std::lock_guard<std::mutex> lock(impl_->mu);
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

struct UniversalReader::Impl {
  fs::path dir;
  UniversalManifest manifest;

  Status Err(const UniversalParamInfo& p, std::string_view state, const std::string& msg) const {
    return DataLossError("file " + (dir / p.file).string() + ", parameter '" + p.name + "'" +
                         (state.empty() ? std::string() : ", state '" + std::string(state) + "'") +
                         ": " + msg);
  }

  Result<std::pair<const UniversalParamInfo*, const UniversalStateInfo*>> Find(
      std::string_view param, std::string_view state) const {
    const UniversalParamInfo* p = nullptr;
    for (const auto& q : manifest.params) {
      if (q.name == param) p = &q;
    }
    if (p == nullptr) {
      return NotFoundError("parameter '" + std::string(param) + "' is not in " + dir.string());
    }
    const UniversalStateInfo* s = FindState(*p, state);
    if (s == nullptr) {
      return NotFoundError("parameter '" + p->name + "' has no state '" + std::string(state) +
                           "' in the manifest of " + dir.string());
    }
    return std::make_pair(p, s);
  }

  Result<H5File> OpenFile(const UniversalParamInfo& p) const {
    auto f = H5File::Open(dir / p.file);
    if (!f.ok()) {
      return DataLossError("parameter '" + p.name + "' field file: " + f.status().message());
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

  Status ReadInto(const H5File& f, const UniversalParamInfo& p, const UniversalStateInfo& s,
                  TensorView out) const {
    UCP_RETURN_IF_ERROR(CheckMeta(f, p, s));
    Status st = f.ReadDatasetInto(s.name, out);
    if (!st.ok()) return Err(p, s.name, st.message());
    const uint64_t want = *ParseXxh3(s.checksum, "checksum");  // validated by the parser
    const uint64_t got = Xxh3_64(out.bytes);
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
  for (const auto& p : impl->manifest.params) {
    auto full = ResolveInside(dir, p.file, "field file");
    if (!full.ok()) {
      return DataLossError(manifest_path.string() + ": parameter '" + p.name + "' " +
                           full.status().message());
    }
    if (!fs::is_regular_file(*full, ec)) {
      return DataLossError(manifest_path.string() + ": parameter '" + p.name + "' field file '" +
                           p.file + "' does not exist");
    }
  }
  return UniversalReader(std::move(impl));
}

Result<const UniversalParamInfo*> UniversalReader::FindParam(std::string_view param) const {
  for (const auto& p : impl_->manifest.params) {
    if (p.name == param) return &p;
  }
  return NotFoundError("parameter '" + std::string(param) + "' is not in " + impl_->dir.string());
}

Result<Tensor> UniversalReader::ReadState(std::string_view param, std::string_view state) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Uninitialized(ps.second->dtype, ps.first->shape));
  UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(*ps.first));
  UCP_RETURN_IF_ERROR(impl_->ReadInto(f, *ps.first, *ps.second, t.view()));
  return t;
}

Status UniversalReader::ReadStateInto(std::string_view param, std::string_view state,
                                      TensorView out) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  if (out.dtype != ps.second->dtype || out.shape != ps.first->shape) {
    return InvalidArgumentError("output for parameter '" + ps.first->name + "' state '" +
                                std::string(state) + "' is " + std::string(DTypeName(out.dtype)) +
                                " " + ShapeToString(out.shape) + " but the checkpoint holds " +
                                std::string(DTypeName(ps.second->dtype)) + " " +
                                ShapeToString(ps.first->shape));
  }
  UCP_RETURN_IF_ERROR(ValidateView(out, "output for parameter '" + ps.first->name + "'"));
  UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(*ps.first));
  return impl_->ReadInto(f, *ps.first, *ps.second, out);
}

Status UniversalReader::ReadStateFlatRange(std::string_view param, std::string_view state,
                                           int64_t begin_elem, int64_t end_elem,
                                           std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(auto ps, impl_->Find(param, state));
  UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(*ps.first));
  UCP_RETURN_IF_ERROR(impl_->CheckMeta(f, *ps.first, *ps.second));
  return f.ReadFlatRange(ps.second->name, begin_elem, end_elem, out);
}

Status UniversalReader::Verify() const {
  // One scratch buffer, grown to the largest state, serves every read: allocating (and faulting
  // in) a fresh buffer per state cost as much as the read itself.
  HostBuffer scratch;
  for (const auto& p : impl_->manifest.params) {
    UCP_ASSIGN_OR_RETURN(H5File f, impl_->OpenFile(p));
    auto name = f.ReadStringAttribute("", kAttrName);
    if (!name.ok()) return impl_->Err(p, "", "attribute name: " + name.status().message());
    if (*name != p.name)
      return impl_->Err(p, "", "attribute name is '" + *name + "', not the parameter's name");
    auto shape = f.ReadInt64ArrayAttribute("", kAttrShape);
    if (!shape.ok()) return impl_->Err(p, "", "attribute shape: " + shape.status().message());
    if (*shape != p.shape) {
      return impl_->Err(p, "",
                        "attribute shape is " + ShapeToString(*shape) + " but the manifest says " +
                            ShapeToString(p.shape));
    }
    auto step = f.ReadInt64Attribute("", kAttrStep);
    if (!step.ok()) return impl_->Err(p, "", "attribute step: " + step.status().message());
    if (*step != impl_->manifest.step) {
      return impl_->Err(p, "",
                        "attribute step is " + std::to_string(*step) + " but the manifest says " +
                            std::to_string(impl_->manifest.step));
    }
    UCP_ASSIGN_OR_RETURN(auto datasets, f.ListDatasets(), "while verifying " + f.path().string());
    for (const auto& d : datasets) {
      if (FindState(p, d) == nullptr) {
        return impl_->Err(p, d, "dataset is in the file but not in the manifest's states");
      }
    }
    for (const auto& s : p.states) {
      UCP_ASSIGN_OR_RETURN(int64_t n, NumElements(p.shape, "parameter '" + p.name + "'"));
      auto checked_bytes = CheckedMul(n, DTypeSizeBytes(s.dtype));
      if (!checked_bytes) return impl_->Err(p, s.name, "field shape: byte count overflows int64");
      const int64_t num_bytes = *checked_bytes;
      if (num_bytes > scratch.num_bytes()) {
        UCP_ASSIGN_OR_RETURN(scratch, HostBuffer::Allocate(num_bytes));
      }
      TensorView view{s.dtype, p.shape, scratch.bytes().first(static_cast<size_t>(num_bytes))};
      UCP_RETURN_IF_ERROR(impl_->ReadInto(f, p, s, view));
    }
  }
  return Status::Ok();
}

}  // namespace ucp::io
