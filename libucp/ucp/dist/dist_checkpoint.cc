// DistWriter / DistReader over H5File and the atomic-folder helpers.
#include "ucp/dist/dist_checkpoint.h"

#include <algorithm>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/checksum.h"
#include "ucp/io/hdf5/h5_file.h"

namespace ucp::dist {

namespace fs = std::filesystem;

struct DistWriter::Impl {
  fs::path dst;
  fs::path tmp;
  int64_t world = 0;
  std::mutex mu;
  std::vector<std::optional<io::H5File>> files;
  std::vector<std::vector<DistTensor>> tensors;
  bool committed = false;

  ~Impl() {
    if (!committed && !tmp.empty()) {
      files.clear();
      io::RemoveTreeBestEffort(tmp);
    }
  }

  Status EnsureFile(int64_t rank) {
    if (files[rank].has_value()) return Status::Ok();
    UCP_ASSIGN_OR_RETURN(io::H5File f, io::H5File::Create(tmp / RankFileName(rank)),
                         "while creating a rank file");
    files[rank].emplace(std::move(f));
    return Status::Ok();
  }
};

DistWriter::DistWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistWriter::DistWriter(DistWriter&&) noexcept = default;
DistWriter& DistWriter::operator=(DistWriter&&) noexcept = default;
DistWriter::~DistWriter() = default;

Result<DistWriter> DistWriter::Create(const fs::path& dst, int64_t world_size) {
  if (world_size < 1) {
    return InvalidArgumentError("world size must be >= 1, got " + std::to_string(world_size));
  }
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  fs::path parent = dst.parent_path().empty() ? fs::path(".") : dst.parent_path();
  fs::create_directories(parent, ec);
  if (ec) return IoError("cannot create folder " + parent.string() + ": " + ec.message());
  auto impl = std::make_unique<Impl>();
  impl->dst = dst;
  impl->world = world_size;
  impl->files.resize(world_size);
  impl->tensors.resize(world_size);
  UCP_ASSIGN_OR_RETURN(impl->tmp, io::MakeTempSiblingDir(dst));
  return DistWriter(std::move(impl));
}

const fs::path& DistWriter::temp_dir() const { return impl_->tmp; }

Status DistWriter::WriteTensor(int64_t rank, std::string_view name, const ConstTensorView& data) {
  if (rank < 0 || rank >= impl_->world) {
    return OutOfRangeError("rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(impl_->world) + ")");
  }
  UCP_RETURN_IF_ERROR(ValidateView(data, "tensor \"" + std::string(name) + "\""));
  const std::string checksum = io::FormatXxh3(io::Xxh3_64(data.bytes));
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->committed) return FailedPreconditionError("checkpoint already committed");
  for (const DistTensor& t : impl_->tensors[rank]) {
    if (t.name == name) {
      return AlreadyExistsError("tensor \"" + std::string(name) + "\" written twice on rank " +
                                std::to_string(rank));
    }
  }
  UCP_RETURN_IF_ERROR(impl_->EnsureFile(rank));
  UCP_RETURN_IF_ERROR(impl_->files[rank]->WriteDataset(name, data),
                      "while writing " + RankFileName(rank));
  impl_->tensors[rank].push_back({std::string(name), data.dtype, data.shape, checksum});
  return Status::Ok();
}

Status DistWriter::Commit(const DistManifest& header) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->committed) return FailedPreconditionError("checkpoint already committed");
  if (!header.ranks.empty()) {
    return InvalidArgumentError("commit header must have no ranks (they come from the writes)");
  }
  DistManifest m = header;
  for (int64_t r = 0; r < impl_->world; ++r) {
    UCP_RETURN_IF_ERROR(impl_->EnsureFile(r));
    UCP_RETURN_IF_ERROR(impl_->files[r]->Close(), "while closing " + RankFileName(r));
    impl_->files[r].reset();
    DistRankFile rf{r, RankFileName(r), std::move(impl_->tensors[r])};
    std::sort(rf.tensors.begin(), rf.tensors.end(),
              [](const DistTensor& a, const DistTensor& b) { return a.name < b.name; });
    m.ranks.push_back(std::move(rf));
  }
  UCP_ASSIGN_OR_RETURN(std::string text, SerializeDistManifest(m));
  UCP_RETURN_IF_ERROR(io::WriteFileAtomic(impl_->tmp / kLayoutFileName, text));
  UCP_RETURN_IF_ERROR(io::FsyncTree(impl_->tmp));
  UCP_RETURN_IF_ERROR(io::RenameNoReplace(impl_->tmp, impl_->dst));
  impl_->committed = true;
  return Status::Ok();
}

struct DistReader::Impl {
  fs::path dir;
  DistManifest manifest;
  mutable std::mutex mu;
  mutable std::vector<std::unique_ptr<io::H5File>> files;

  Result<const io::H5File*> File(int64_t rank) const {
    std::lock_guard<std::mutex> lock(mu);
    if (!files[rank]) {
      const fs::path p = dir / RankFileName(rank);
      Result<io::H5File> f = io::H5File::Open(p);
      if (!f.ok()) {
        if (f.status().code() == StatusCode::kNotFound) {
          return DataLossError("rank file " + p.string() + " is missing");
        }
        return DataLossError("rank file " + p.string() + " is unreadable: " + f.status().message());
      }
      files[rank] = std::make_unique<io::H5File>(std::move(*f));
    }
    return files[rank].get();
  }
};

DistReader::DistReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistReader::DistReader(DistReader&&) noexcept = default;
DistReader& DistReader::operator=(DistReader&&) noexcept = default;
DistReader::~DistReader() = default;

Result<DistReader> DistReader::Open(const fs::path& dir) {
  if (io::IsTempName(dir.filename().string())) {
    return FailedPreconditionError(dir.string() + " is an unfinished write (a .tmp- folder)");
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return NotFoundError("no checkpoint folder " + dir.string());
  const fs::path mf = dir / kLayoutFileName;
  Result<std::string> text = io::ReadFileToString(mf, int64_t{256} << 20);
  if (!text.ok()) {
    if (text.status().code() == StatusCode::kNotFound) {
      return NotFoundError(dir.string() + " has no " + std::string(kLayoutFileName) +
                           ": not a complete distributed checkpoint");
    }
    return text.status();
  }
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  UCP_ASSIGN_OR_RETURN(impl->manifest, ParseDistManifest(*text, mf.string()));
  for (const DistRankFile& r : impl->manifest.ranks) {
    if (!fs::is_regular_file(dir / r.file, ec)) {
      return DataLossError("rank file " + (dir / r.file).string() + " is missing (rank " +
                           std::to_string(r.rank) + " of " +
                           std::to_string(impl->manifest.ranks.size()) + ")");
    }
  }
  impl->files.resize(impl->manifest.ranks.size());
  return DistReader(std::move(impl));
}

const DistManifest& DistReader::manifest() const { return impl_->manifest; }
const fs::path& DistReader::dir() const { return impl_->dir; }

Result<const DistTensor*> DistReader::FindTensor(int64_t rank, std::string_view name) const {
  if (rank < 0 || rank >= static_cast<int64_t>(impl_->manifest.ranks.size())) {
    return NotFoundError("rank " + std::to_string(rank) + " not in the checkpoint (" +
                         std::to_string(impl_->manifest.ranks.size()) + " ranks)");
  }
  const auto& ts = impl_->manifest.ranks[rank].tensors;
  auto it = std::lower_bound(ts.begin(), ts.end(), name,
                             [](const DistTensor& t, std::string_view n) { return t.name < n; });
  if (it == ts.end() || it->name != name) {
    return NotFoundError("tensor \"" + std::string(name) + "\" not in " + RankFileName(rank) +
                         " of the manifest");
  }
  return &*it;
}

namespace {

Status CheckMeta(const io::H5File& f, const DistTensor& t) {
  Result<io::DatasetMeta> meta = f.DatasetInfo(t.name);
  if (!meta.ok()) {
    return DataLossError(f.path().string() + ": tensor \"" + t.name +
                         "\": " + meta.status().message());
  }
  if (meta->dtype != t.dtype || meta->shape != t.shape) {
    return DataLossError(f.path().string() + ": tensor \"" + t.name + "\": stored " +
                         std::string(DTypeName(meta->dtype)) + ShapeToString(meta->shape) +
                         ", manifest says " + std::string(DTypeName(t.dtype)) +
                         ShapeToString(t.shape));
  }
  return Status::Ok();
}

}  // namespace

Result<Tensor> DistReader::ReadTensor(int64_t rank, std::string_view name) const {
  UCP_ASSIGN_OR_RETURN(const DistTensor* t, FindTensor(rank, name));
  UCP_ASSIGN_OR_RETURN(const io::H5File* f, impl_->File(rank));
  UCP_RETURN_IF_ERROR(CheckMeta(*f, *t));
  Result<Tensor> data = f->ReadDataset(t->name);
  if (!data.ok()) {
    return DataLossError(f->path().string() + ": tensor \"" + t->name +
                         "\": " + data.status().message());
  }
  const std::string sum = io::FormatXxh3(io::Xxh3_64(data->view().bytes));
  if (sum != t->checksum) {
    return DataLossError(f->path().string() + ": tensor \"" + t->name + "\": checksum " + sum +
                         " differs from the manifest's " + t->checksum);
  }
  return data;
}

Status DistReader::ReadFlatRange(int64_t rank, std::string_view name, int64_t begin_elem,
                                 int64_t end_elem, std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(const DistTensor* t, FindTensor(rank, name));
  UCP_ASSIGN_OR_RETURN(const io::H5File* f, impl_->File(rank));
  Status s = f->ReadFlatRange(t->name, begin_elem, end_elem, out);
  if (!s.ok() && s.code() != StatusCode::kOutOfRange && s.code() != StatusCode::kInvalidArgument) {
    return DataLossError(f->path().string() + ": tensor \"" + t->name + "\": " + s.message());
  }
  return s;
}

Status DistReader::Verify() const {
  for (const DistRankFile& r : impl_->manifest.ranks) {
    UCP_ASSIGN_OR_RETURN(const io::H5File* f, impl_->File(r.rank));
    Result<std::vector<std::string>> names = f->ListDatasets();
    if (!names.ok()) {
      return DataLossError(f->path().string() +
                           ": cannot list datasets: " + names.status().message());
    }
    if (names->size() != r.tensors.size()) {
      return DataLossError(f->path().string() + ": holds " + std::to_string(names->size()) +
                           " datasets, the manifest lists " + std::to_string(r.tensors.size()));
    }
    for (const DistTensor& t : r.tensors) {
      UCP_RETURN_IF_ERROR(ReadTensor(r.rank, t.name).status());
    }
  }
  return Status::Ok();
}

}  // namespace ucp::dist
