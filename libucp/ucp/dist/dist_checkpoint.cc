// DistWriter / DistReader: metadata through H5File, contents through RawFile at the datasets'
// offsets, and the atomic-folder helpers.
#include "ucp/dist/dist_checkpoint.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/atomic_file.h"
#include "ucp/io/checksum.h"
#include "ucp/io/hdf5/h5_file.h"
#include "ucp/io/interrupt.h"
#include "ucp/io/raw_file.h"
#include "ucp/io/read_verifier.h"
#include "ucp/io/streamed_dataset.h"

namespace ucp::dist {

namespace fs = std::filesystem;

namespace {

// One rank file being written.
struct RankOut {
  std::vector<DistTensorDecl> decls;                          // declaration order
  std::map<std::string, size_t, std::less<>> index;           // name -> decls index
  std::vector<std::unique_ptr<io::StreamedDataset>> streams;  // per decl, once created
  std::once_flag created;
  Status create_status;
  std::optional<io::RawFile> raw;
  std::atomic<int64_t> remaining{0};  // tensors not yet complete
  std::mutex close_mu;
  bool closed = false;
  bool owned = true;                                       // this writer creates the file
  std::map<std::string, std::string, std::less<>> remote;  // name -> checksum, from AddPart
  bool remote_file = false;                                // another process reported the file
};

Status CheckComplete(const io::StreamedDataset& ds, const DistTensorDecl& d, int64_t rank) {
  if (ds.complete()) return Status::Ok();
  return FailedPreconditionError("tensor \"" + d.name + "\" of rank " + std::to_string(rank) +
                                 " is incomplete: " + std::to_string(ds.elements_written()) +
                                 " of " + std::to_string(ds.num_elems()) + " elements written");
}

}  // namespace

struct DistWriter::Impl {
  fs::path dst;
  fs::path tmp;
  bool joined = false;  // another process created tmp and commits
  int64_t world = 0;
  std::vector<std::unique_ptr<RankOut>> ranks;
  std::mutex mu;
  bool committed = false;

  ~Impl() {
    if (!committed && !joined && !tmp.empty()) {
      ranks.clear();
      io::RemoveTreeBestEffort(tmp);
    }
    if (joined) io::UnregisterTempPath(tmp);
  }

  // Creates rank r's file with every declared dataset, once.
  Status EnsureFile(int64_t r) {
    RankOut& out = *ranks[r];
    std::call_once(out.created, [&] {
      out.create_status = [&]() -> Status {
        const fs::path path = tmp / RankFileName(r);
        UCP_ASSIGN_OR_RETURN(io::H5File f, io::H5File::Create(path), "while creating a rank file");
        for (const DistTensorDecl& d : out.decls) {
          UCP_ASSIGN_OR_RETURN(int64_t offset, f.CreateDirectDataset(d.name, d.dtype, d.shape),
                               "while creating " + path.string());
          out.streams.push_back(std::make_unique<io::StreamedDataset>(
              "tensor \"" + d.name + "\" of " + path.string(), offset, NumElementsOrDie(d.shape),
              DTypeSizeBytes(d.dtype)));
        }
        UCP_RETURN_IF_ERROR(f.Close(), "while closing " + path.string());
        UCP_ASSIGN_OR_RETURN(io::RawFile raw, io::RawFile::OpenForWrite(path));
        out.raw.emplace(std::move(raw));
        int64_t pending = 0;
        for (const DistTensorDecl& d : out.decls) pending += NumElementsOrDie(d.shape) > 0;
        out.remaining = pending;
        if (pending == 0) return CloseFile(out);
        return Status::Ok();
      }();
    });
    return out.create_status;
  }

  Status CloseFile(RankOut& out) {
    std::lock_guard<std::mutex> lock(out.close_mu);
    if (out.closed) return Status::Ok();
    out.closed = true;
    if (joined) {
      // The committing process may be on another machine: this one makes its own files durable.
      UCP_RETURN_IF_ERROR(out.raw->Sync());
    } else {
      // Writeback starts now; Commit's fsync of the folder waits for it. An fsync here would
      // stall this worker on the disk while it could be building the next tensor.
      UCP_RETURN_IF_ERROR(out.raw->StartWriteback());
    }
    return out.raw->Close();
  }
};

DistWriter::DistWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DistWriter::DistWriter(DistWriter&&) noexcept = default;
DistWriter& DistWriter::operator=(DistWriter&&) noexcept = default;
DistWriter::~DistWriter() = default;

Result<DistWriter> DistWriter::Create(const fs::path& dst_in, int64_t world_size,
                                      std::vector<DistTensorDecl> tensors,
                                      const DistWriteOptions& options) {
  // "out/" names the folder "out" (whose parent is ".", not "out" itself).
  const fs::path dst = io::WithoutTrailingSlash(dst_in);
  if (world_size < 1) {
    return InvalidArgumentError("world size must be >= 1, got " + std::to_string(world_size));
  }
  std::error_code ec;
  if (fs::exists(dst, ec)) {
    return AlreadyExistsError("output " + dst.string() + " exists; refusing to overwrite it");
  }
  auto impl = std::make_unique<Impl>();
  impl->dst = dst;
  impl->world = world_size;
  for (int64_t r = 0; r < world_size; ++r) impl->ranks.push_back(std::make_unique<RankOut>());
  for (DistTensorDecl& d : tensors) {
    if (d.rank < 0 || d.rank >= world_size) {
      return InvalidArgumentError("tensor \"" + d.name + "\" declared on rank " +
                                  std::to_string(d.rank) + " outside [0, " +
                                  std::to_string(world_size) + ")");
    }
    RankOut& out = *impl->ranks[d.rank];
    if (!out.index.emplace(d.name, out.decls.size()).second) {
      return InvalidArgumentError("tensor \"" + d.name + "\" declared twice on rank " +
                                  std::to_string(d.rank));
    }
    out.decls.push_back(std::move(d));
  }
  if (options.owned_ranks.has_value()) {
    for (auto& r : impl->ranks) r->owned = false;
    for (int64_t r : *options.owned_ranks) {
      if (r < 0 || r >= world_size) {
        return InvalidArgumentError("owned rank " + std::to_string(r) + " outside [0, " +
                                    std::to_string(world_size) + ")");
      }
      impl->ranks[r]->owned = true;
    }
  }
  if (!options.join_temp.empty()) {
    if (!fs::is_directory(options.join_temp, ec)) {
      return NotFoundError("temporary folder " + options.join_temp.string() +
                           " to join does not exist");
    }
    impl->tmp = options.join_temp;
    impl->joined = true;
    // Whichever process a signal reaches first removes the shared folder (io/interrupt.h).
    io::RegisterTempPath(impl->tmp);
    return DistWriter(std::move(impl));
  }
  fs::path parent = dst.parent_path().empty() ? fs::path(".") : dst.parent_path();
  fs::create_directories(parent, ec);
  if (ec) return IoError("cannot create folder " + parent.string() + ": " + ec.message());
  UCP_ASSIGN_OR_RETURN(impl->tmp, io::MakeTempSiblingDir(dst));
  return DistWriter(std::move(impl));
}

const fs::path& DistWriter::temp_dir() const { return impl_->tmp; }

Status DistWriter::WriteRange(int64_t rank, std::string_view name, int64_t begin_elem,
                              std::span<const std::byte> data) {
  if (rank < 0 || rank >= impl_->world) {
    return OutOfRangeError("rank " + std::to_string(rank) + " outside [0, " +
                           std::to_string(impl_->world) + ")");
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->committed) return FailedPreconditionError("checkpoint already committed");
  }
  RankOut& out = *impl_->ranks[rank];
  auto it = out.index.find(name);
  if (it == out.index.end()) {
    return NotFoundError("tensor \"" + std::string(name) + "\" is not declared on rank " +
                         std::to_string(rank));
  }
  if (!out.owned) {
    return FailedPreconditionError("rank " + std::to_string(rank) +
                                   "'s file is written by another process");
  }
  UCP_RETURN_IF_ERROR(impl_->EnsureFile(rank));
  io::StreamedDataset& ds = *out.streams[it->second];
  if (ds.num_elems() == 0) {
    if (!data.empty()) {
      return InvalidArgumentError("tensor \"" + std::string(name) + "\" has no elements");
    }
    return Status::Ok();
  }
  UCP_RETURN_IF_ERROR(ds.Append(*out.raw, begin_elem, data));
  if (ds.complete() && --out.remaining == 0) return impl_->CloseFile(out);
  return Status::Ok();
}

Status DistWriter::WriteTensor(int64_t rank, std::string_view name, const ConstTensorView& data) {
  UCP_RETURN_IF_ERROR(ValidateView(data, "tensor \"" + std::string(name) + "\""));
  if (rank >= 0 && rank < impl_->world) {
    const RankOut& out = *impl_->ranks[rank];
    auto it = out.index.find(name);
    if (it != out.index.end()) {
      const DistTensorDecl& d = out.decls[it->second];
      if (d.dtype != data.dtype || d.shape != data.shape) {
        return InvalidArgumentError("tensor \"" + d.name + "\" is " +
                                    std::string(DTypeName(data.dtype)) + ShapeToString(data.shape) +
                                    " but was declared " + std::string(DTypeName(d.dtype)) +
                                    ShapeToString(d.shape));
      }
    }
  }
  return WriteRange(rank, name, 0, data.bytes);
}

// A part is text: "file\t<rank>" for each owned rank file, then "tensor\t<rank>\t<name>\t
// <checksum>" for each of its tensors. Tensor names never hold tabs or newlines (plan.h).
Result<std::string> DistWriter::LocalPart() {
  std::string text;
  for (int64_t r = 0; r < impl_->world; ++r) {
    RankOut& out = *impl_->ranks[r];
    if (!out.owned) continue;
    UCP_RETURN_IF_ERROR(impl_->EnsureFile(r));
    text += "file\t" + std::to_string(r) + "\n";
    for (size_t i = 0; i < out.decls.size(); ++i) {
      const io::StreamedDataset& ds = *out.streams[i];
      UCP_RETURN_IF_ERROR(CheckComplete(ds, out.decls[i], r));
      if (out.decls[i].name.find_first_of("\t\n") != std::string::npos) {
        return InvalidArgumentError("tensor name \"" + out.decls[i].name +
                                    "\" holds a tab or newline");
      }
      text +=
          "tensor\t" + std::to_string(r) + "\t" + out.decls[i].name + "\t" + ds.checksum() + "\n";
    }
    UCP_RETURN_IF_ERROR(impl_->CloseFile(out));
  }
  return text;
}

Status DistWriter::AddPart(std::string_view part) {
  auto bad = [](const std::string& why) {
    return DataLossError("part from another process: " + why);
  };
  size_t pos = 0;
  while (pos < part.size()) {
    size_t eol = part.find('\n', pos);
    if (eol == std::string_view::npos) return bad("unterminated line");
    std::vector<std::string> f;
    std::string_view line = part.substr(pos, eol - pos);
    pos = eol + 1;
    size_t start = 0;
    while (true) {
      size_t tab = line.find('\t', start);
      f.emplace_back(line.substr(start, tab == std::string_view::npos ? line.npos : tab - start));
      if (tab == std::string_view::npos) break;
      start = tab + 1;
    }
    if (f.size() < 2 || f[1].empty() || f[1].size() > 18 ||
        f[1].find_first_not_of("0123456789") != std::string::npos) {
      return bad("malformed line \"" + std::string(line.substr(0, 80)) + "\"");
    }
    const int64_t r = std::stoll(f[1]);
    if (r >= impl_->world) return bad("rank " + f[1] + " outside the layout");
    RankOut& out = *impl_->ranks[r];
    if (f[0] == "file" && f.size() == 2) {
      if (out.owned || out.remote_file) return bad("rank file " + f[1] + " reported twice");
      out.remote_file = true;
    } else if (f[0] == "tensor" && f.size() == 4) {
      if (!out.remote_file) return bad("tensor before its rank file in rank " + f[1]);
      if (!out.index.count(f[2]))
        return bad("tensor \"" + f[2] + "\" not declared on rank " + f[1]);
      UCP_RETURN_IF_ERROR(io::ParseXxh3(f[3], "checksum of tensor \"" + f[2] + "\"").status());
      if (!out.remote.emplace(f[2], f[3]).second) {
        return bad("tensor \"" + f[2] + "\" of rank " + f[1] + " reported twice");
      }
    } else {
      return bad("malformed line \"" + std::string(line.substr(0, 80)) + "\"");
    }
  }
  return Status::Ok();
}

Status DistWriter::Commit(const DistManifest& header) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->committed) return FailedPreconditionError("checkpoint already committed");
  if (!header.ranks.empty()) {
    return InvalidArgumentError("commit header must have no ranks (they come from the writes)");
  }
  if (impl_->joined) {
    return FailedPreconditionError("a writer that joined another process's folder cannot commit");
  }
  DistManifest m = header;
  for (int64_t r = 0; r < impl_->world; ++r) {
    RankOut& out = *impl_->ranks[r];
    DistRankFile rf{r, RankFileName(r), {}};
    if (!out.owned) {
      if (!out.remote_file) {
        return FailedPreconditionError("no process reported rank file " + RankFileName(r));
      }
      for (const DistTensorDecl& d : out.decls) {
        auto it = out.remote.find(d.name);
        if (it == out.remote.end()) {
          return FailedPreconditionError("tensor \"" + d.name + "\" of rank " + std::to_string(r) +
                                         " was not reported by its process");
        }
        rf.tensors.push_back({d.name, d.dtype, d.shape, it->second});
      }
      std::sort(rf.tensors.begin(), rf.tensors.end(),
                [](const DistTensor& a, const DistTensor& b) { return a.name < b.name; });
      m.ranks.push_back(std::move(rf));
      continue;
    }
    UCP_RETURN_IF_ERROR(impl_->EnsureFile(r));
    for (size_t i = 0; i < out.decls.size(); ++i) {
      const io::StreamedDataset& ds = *out.streams[i];
      UCP_RETURN_IF_ERROR(CheckComplete(ds, out.decls[i], r));
      rf.tensors.push_back(
          {out.decls[i].name, out.decls[i].dtype, out.decls[i].shape, ds.checksum()});
    }
    UCP_RETURN_IF_ERROR(impl_->CloseFile(out));
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

// ---- Reader ---------------------------------------------------------------------------------

namespace {

// Where a rank file's tensors are, found once per file: per manifest tensor, the byte offset of
// its data (-1: read through HDF5).
struct RankLayout {
  std::once_flag once;
  Status status;                      // the file itself
  std::vector<int64_t> offsets;       // per manifest tensor
  std::vector<Status> tensor_status;  // per manifest tensor: dtype, shape, extent checks
};

}  // namespace

struct DistReader::Impl {
  fs::path dir;
  DistManifest manifest;
  std::unique_ptr<RankLayout[]> layouts;
  mutable io::RawFileCache files;
  // VerifyReads (issue 14): one XXH3 record per manifest tensor, in (rank, tensor) order; or
  // null.
  mutable std::unique_ptr<io::ReadVerifier> verifier;
  mutable std::map<const DistTensor*, int32_t> record_of;

  fs::path PathOf(int64_t rank) const { return dir / RankFileName(rank); }

  Result<io::H5File> OpenH5(int64_t rank) const {
    const fs::path p = PathOf(rank);
    // Seen before HDF5 reads it, so that a change from here to the commit is caught.
    Status noted = files.Note(p);
    if (!noted.ok() && noted.code() != StatusCode::kNotFound) return noted;
    Result<io::H5File> f = io::H5File::Open(p);
    if (!f.ok()) {
      if (f.status().code() == StatusCode::kNotFound) {
        // A missing file is not_found, as a DeepSpeed folder's missing rank file is (exit 4).
        return NotFoundError("rank file " + p.string() + " is missing");
      }
      if (f.status().code() == StatusCode::kResourceExhausted ||
          f.status().code() == StatusCode::kIoError) {
        return Status(f.status().code(), "rank file " + p.string() + ": " + f.status().message());
      }
      return DataLossError("rank file " + p.string() + " is unreadable: " + f.status().message());
    }
    return f;
  }

  static Status CheckMeta(const io::H5File& f, const DistTensor& t) {
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

  Result<const RankLayout*> Layout(int64_t rank) const {
    RankLayout& l = layouts[rank];
    std::call_once(l.once, [&] {
      l.status = [&]() -> Status {
        UCP_ASSIGN_OR_RETURN(io::H5File f, OpenH5(rank));
        for (const DistTensor& t : manifest.ranks[rank].tensors) {
          l.offsets.push_back(-1);
          l.tensor_status.push_back([&]() -> Status {
            UCP_RETURN_IF_ERROR(CheckMeta(f, t));
            Result<int64_t> off = f.DirectOffset(t.name);
            if (!off.ok()) {
              return DataLossError(f.path().string() + ": tensor \"" + t.name +
                                   "\": " + off.status().message());
            }
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

  // The byte offset of a tensor (-1: through HDF5), once checked.
  Result<int64_t> OffsetOf(int64_t rank, const DistTensor& t) const {
    UCP_ASSIGN_OR_RETURN(const RankLayout* l, Layout(rank));
    const size_t i = IndexOf(rank, &t);
    UCP_RETURN_IF_ERROR(l->tensor_status[i]);
    return l->offsets[i];
  }

  size_t IndexOf(int64_t rank, const DistTensor* t) const {
    return static_cast<size_t>(t - manifest.ranks[rank].tensors.data());
  }

  // Reads bytes of tensor `t` of `rank` starting at element `begin`.
  Status ReadAt(int64_t rank, const DistTensor& t, int64_t begin, int64_t end,
                std::span<std::byte> out) const {
    UCP_ASSIGN_OR_RETURN(int64_t off, OffsetOf(rank, t));
    if (off >= 0) {
      UCP_ASSIGN_OR_RETURN(std::shared_ptr<const io::RawFile> raw, files.Get(PathOf(rank)));
      Status st = raw->ReadAt(off + begin * DTypeSizeBytes(t.dtype), out);
      if (!st.ok()) {
        return DataLossError(PathOf(rank).string() + ": tensor \"" + t.name +
                             "\": " + st.message());
      }
      return Status::Ok();
    }
    UCP_ASSIGN_OR_RETURN(io::H5File f, OpenH5(rank));
    Status s = f.ReadFlatRange(t.name, begin, end, out);
    if (!s.ok()) {
      return DataLossError(f.path().string() + ": tensor \"" + t.name + "\": " + s.message());
    }
    return Status::Ok();
  }

  Status CheckSum(int64_t rank, const DistTensor& t, uint64_t got) const {
    const std::string sum = io::FormatXxh3(got);
    if (sum != t.checksum) {
      return DataLossError(PathOf(rank).string() + ": tensor \"" + t.name + "\": checksum " + sum +
                           " differs from the manifest's " + t.checksum);
    }
    return Status::Ok();
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
    const fs::file_status fst = fs::status(dir / r.file, ec);
    if (fs::exists(fst) && !fs::is_regular_file(fst)) {
      // A FIFO, socket or device where a rank file belongs: the environment, not corruption.
      return IoError("rank file " + (dir / r.file).string() + " is not a regular file");
    }
    if (!fs::is_regular_file(fst)) {
      return NotFoundError("rank file " + (dir / r.file).string() + " is missing (rank " +
                           std::to_string(r.rank) + " of " +
                           std::to_string(impl->manifest.ranks.size()) + ")");
    }
  }
  impl->layouts = std::make_unique<RankLayout[]>(impl->manifest.ranks.size());
  return DistReader(std::move(impl));
}

const DistManifest& DistReader::manifest() const { return impl_->manifest; }
const fs::path& DistReader::dir() const { return impl_->dir; }
Status DistReader::CheckSourcesUnchanged() const { return impl_->files.CheckUnchanged(); }

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

Result<Tensor> DistReader::ReadTensor(int64_t rank, std::string_view name) const {
  UCP_ASSIGN_OR_RETURN(const DistTensor* t, FindTensor(rank, name));
  UCP_ASSIGN_OR_RETURN(Tensor data, Tensor::Uninitialized(t->dtype, t->shape));
  const int64_t n = data.num_elements();
  if (n > 0) UCP_RETURN_IF_ERROR(impl_->ReadAt(rank, *t, 0, n, data.view().bytes));
  progress::AddBytes(static_cast<int64_t>(data.view().bytes.size()));
  UCP_RETURN_IF_ERROR(impl_->CheckSum(rank, *t, io::Xxh3_64(data.view().bytes)));
  return data;
}

Status DistReader::ReadFlatRange(int64_t rank, std::string_view name, int64_t begin_elem,
                                 int64_t end_elem, std::span<std::byte> out) const {
  UCP_ASSIGN_OR_RETURN(const DistTensor* t, FindTensor(rank, name));
  const int64_t n = NumElementsOrDie(t->shape);
  const int64_t size = DTypeSizeBytes(t->dtype);
  if (begin_elem < 0 || end_elem < begin_elem || end_elem > n) {
    return OutOfRangeError("element range [" + std::to_string(begin_elem) + ", " +
                           std::to_string(end_elem) + ") is outside tensor \"" + t->name +
                           "\" of " + RankFileName(rank) + " (" + std::to_string(n) + " elements)");
  }
  if (static_cast<int64_t>(out.size()) != (end_elem - begin_elem) * size) {
    return InvalidArgumentError("output for range [" + std::to_string(begin_elem) + ", " +
                                std::to_string(end_elem) + ") of tensor \"" + t->name + "\" is " +
                                std::to_string(out.size()) + " bytes, expected " +
                                std::to_string((end_elem - begin_elem) * size));
  }
  if (out.empty()) return Status::Ok();
  UCP_RETURN_IF_ERROR(impl_->ReadAt(rank, *t, begin_elem, end_elem, out));
  if (impl_->verifier == nullptr) return Status::Ok();
  return impl_->verifier->Observe(impl_->record_of.at(t), begin_elem * size, out);
}

void DistReader::VerifyReads() const {
  auto v = std::make_unique<io::ReadVerifier>();
  impl_->record_of.clear();
  for (const DistRankFile& r : impl_->manifest.ranks) {
    for (const DistTensor& t : r.tensors) {
      const int64_t size = DTypeSizeBytes(t.dtype);
      const uint64_t want = *io::ParseXxh3(t.checksum, "checksum");  // validated by the parser
      const Impl* impl = impl_.get();
      const int64_t rank = r.rank;
      const DistTensor* tp = &t;
      impl_->record_of[&t] = v->AddXxh3(
          NumElementsOrDie(t.shape) * size, want,
          impl_->PathOf(rank).string() + ": tensor \"" + t.name +
              "\": checksum of the data differs from the manifest's " + t.checksum,
          [impl, rank, tp, size](int64_t offset, std::span<std::byte> out) {
            return impl->ReadAt(rank, *tp, offset / size,
                                (offset + static_cast<int64_t>(out.size())) / size, out);
          });
    }
  }
  impl_->verifier = std::move(v);
}

int64_t DistReader::verify_bytes_reread() const {
  return impl_->verifier == nullptr ? 0 : impl_->verifier->bytes_reread();
}

Status DistReader::Verify(int part, int parts) const { return VerifyShare(part, parts, false); }

Status DistReader::FinishVerifiedReads(int part, int parts) const {
  return VerifyShare(part, parts, true);
}

Status DistReader::VerifyShare(int part, int parts, bool finish_reads) const {
  // Every rank file's dataset list, then every tensor hashed in bounded pieces straight from
  // its file, tensors in parallel. The first failure in (rank, name) order is reported.
  struct Item {
    int64_t rank;
    const DistTensor* t;
  };
  std::vector<Item> items;
  size_t k = 0;
  for (const DistRankFile& r : impl_->manifest.ranks) {
    for (const DistTensor& t : r.tensors) {
      if (k++ % parts == static_cast<size_t>(part)) items.push_back({r.rank, &t});
    }
    if (r.rank % parts != part) continue;
    UCP_RETURN_IF_ERROR(impl_->Layout(r.rank).status());
    UCP_ASSIGN_OR_RETURN(io::H5File f, impl_->OpenH5(r.rank));
    Result<std::vector<std::string>> names = f.ListDatasets();
    if (!names.ok()) {
      return DataLossError(f.path().string() +
                           ": cannot list datasets: " + names.status().message());
    }
    if (names->size() != r.tensors.size()) {
      return DataLossError(f.path().string() + ": holds " + std::to_string(names->size()) +
                           " datasets, the manifest lists " + std::to_string(r.tensors.size()));
    }
  }
  if (finish_reads && impl_->verifier != nullptr) {
    // One read of the source: each tensor's hash from the conversion's reads, finished by
    // reading only what they did not cover.
    UCP_RETURN_IF_ERROR(impl_->verifier->FirstFailure());
    std::vector<Status> results(items.size());
    tbb::parallel_for(size_t{0}, items.size(), [&](size_t i) {
      results[i] = [&]() -> Status {
        UCP_RETURN_IF_ERROR(impl_->OffsetOf(items[i].rank, *items[i].t).status());
        return impl_->verifier->Finish(impl_->record_of.at(items[i].t));
      }();
    });
    for (Status& s : results) UCP_RETURN_IF_ERROR(s);
    return Status::Ok();
  }
  std::vector<Status> results(items.size());
  tbb::parallel_for(size_t{0}, items.size(), [&](size_t i) {
    const Item& it = items[i];
    results[i] = [&]() -> Status {
      const int64_t bytes = NumElementsOrDie(it.t->shape) * DTypeSizeBytes(it.t->dtype);
      UCP_ASSIGN_OR_RETURN(int64_t off, impl_->OffsetOf(it.rank, *it.t));
      if (off < 0) return ReadTensor(it.rank, it.t->name).status();
      UCP_ASSIGN_OR_RETURN(std::shared_ptr<const io::RawFile> raw,
                           impl_->files.Get(impl_->PathOf(it.rank)));
      Result<uint64_t> h = io::HashFileRange(*raw, off, bytes);
      if (!h.ok()) {
        return DataLossError(impl_->PathOf(it.rank).string() + ": tensor \"" + it.t->name +
                             "\": " + h.status().message());
      }
      return impl_->CheckSum(it.rank, *it.t, *h);
    }();
  });
  for (Status& s : results) UCP_RETURN_IF_ERROR(s);
  return Status::Ok();
}

}  // namespace ucp::dist
