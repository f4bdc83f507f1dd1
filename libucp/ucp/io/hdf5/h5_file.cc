// H5File over the HDF5 1.10 C API. Every call runs under Hdf5Lock(); parallel zstd work runs in
// oneTBB tasks with the lock released, and only direct chunk reads/writes touch HDF5.
#include "ucp/io/hdf5/h5_file.h"

#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <system_error>

#include "ucp/base/checked_math.h"
#include "ucp/base/status_macros.h"
#include "ucp/io/hdf5/byte_shuffle.h"
#include "ucp/io/hdf5/h5z_zstd.h"
#include "ucp/io/zstd/zstd_codec.h"

static_assert(std::endian::native == std::endian::little,
              "ucp stores little-endian data and assumes a little-endian host");

namespace ucp::io {
namespace fs = std::filesystem;
namespace {

// Limits hit while opening (too many open files, no memory) are resource_exhausted, never
// data_loss: the file is fine, the process is not.
bool IsResourceErrno(int e) { return e == EMFILE || e == ENFILE || e == ENOMEM; }
Status OsError(const std::string& what, int e) {
  if (IsResourceErrno(e)) return ResourceExhaustedError(what + ": " + std::strerror(e));
  return ErrnoError(what, e);
}

constexpr int kMaxRank = 32;
constexpr int64_t kMinChunkBytes = int64_t{4} << 10;
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;
constexpr H5Z_filter_t kShuffleId = H5Z_FILTER_SHUFFLE;

// ---- Locking and errors -------------------------------------------------------------------

// Every HDF5 call is made under this lock, so its first use precedes the library's
// initialization: the place to tell HDF5 not to install its atexit handler. That handler
// (H5_term_library) closes the files still open at exit, and on a file whose flush or close
// failed (a full disk) HDF5 1.10 has already torn down part of the file's state, so the retry
// crashes in H5F__close_cb (issue 16 #3): a clean io_error exit became SIGSEGV. ucp closes every
// file it writes explicitly (H5File::Close, reporting errors); what is open at exit is a file
// that already failed, or a reader, neither of which needs HDF5's shutdown. The OS releases the
// rest.
std::recursive_mutex& Hdf5Mutex() {
  static std::recursive_mutex m;
  static const bool no_atexit = [] {
    H5dont_atexit();
    return true;
  }();
  (void)no_atexit;
  return m;
}

// Holds the HDF5 lock; on first use in a thread, turns off HDF5's automatic error printing
// (the error stack is per thread in a thread-safe build) and registers the zstd filter.
class Hdf5Lock {
 public:
  Hdf5Lock() : lock_(Hdf5Mutex()) {
    thread_local bool silenced = false;
    if (!silenced) {
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      silenced = true;
    }
    RegisterZstdFilterLocked().IgnoreError();  // a failure shows when a filtered read fails
  }

 private:
  std::lock_guard<std::recursive_mutex> lock_;
};

herr_t CollectError(unsigned n, const H5E_error2_t* err, void* data) {
  auto* out = static_cast<std::vector<std::string>*>(data);
  (void)n;
  if (err->desc != nullptr && *err->desc != '\0') out->emplace_back(err->desc);
  return 0;
}

// HDF5's messages from the current error stack, outermost and innermost, then clears it.
std::string TakeHdf5Error() {
  std::vector<std::string> msgs;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, CollectError, &msgs);
  H5Eclear2(H5E_DEFAULT);
  if (msgs.empty()) return "no hdf5 message";
  if (msgs.size() == 1) return msgs.front();
  return msgs.front() + ": " + msgs.back();
}

Status H5Error(StatusCode code, const std::string& what) {
  return Status(code, what + " (hdf5: " + TakeHdf5Error() + ")");
}

// ---- RAII handles -------------------------------------------------------------------------

class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(Handle&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      Reset();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { Reset(); }
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Gives up ownership without closing.
  hid_t Release() {
    hid_t id = id_;
    id_ = H5I_INVALID_HID;
    return id;
  }
  void Reset() {
    if (id_ >= 0 && closer_ != nullptr) closer_(id_);
    id_ = H5I_INVALID_HID;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Wraps a freshly returned id, or reports HDF5's error with `code`.
Result<Handle> Wrap(hid_t id, Handle::Closer closer, StatusCode code, const std::string& what) {
  if (id < 0) return H5Error(code, what);
  return Handle(id, closer);
}
Status Check(herr_t rc, StatusCode code, const std::string& what) {
  if (rc < 0) return H5Error(code, what);
  return Status::Ok();
}

// ---- Types --------------------------------------------------------------------------------

// The stored (and in-memory) HDF5 type of a ucp dtype. Always little-endian.
Result<Handle> StorageType(DType d) {
  auto copy = [](hid_t base) {
    return Wrap(H5Tcopy(base), H5Tclose, StatusCode::kIoError, "H5Tcopy");
  };
  switch (d) {
    case DType::kFp64:
      return copy(H5T_IEEE_F64LE);
    case DType::kFp32:
      return copy(H5T_IEEE_F32LE);
    case DType::kFp16: {
      UCP_ASSIGN_OR_RETURN(Handle t, copy(H5T_IEEE_F32LE));
      // IEEE half: sign bit 15, exponent bits 10..14 (bias 15), mantissa bits 0..9.
      if (H5Tset_fields(t.get(), 15, 10, 5, 0, 10) < 0 || H5Tset_precision(t.get(), 16) < 0 ||
          H5Tset_size(t.get(), 2) < 0 || H5Tset_ebias(t.get(), 15) < 0) {
        return H5Error(StatusCode::kInternal, "cannot build the fp16 hdf5 type");
      }
      return t;
    }
    case DType::kBf16:
      return copy(H5T_STD_U16LE);
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8:
      return copy(H5T_STD_U8LE);
    case DType::kInt8:
      return copy(H5T_STD_I8LE);
    case DType::kInt16:
      return copy(H5T_STD_I16LE);
    case DType::kInt32:
      return copy(H5T_STD_I32LE);
    case DType::kInt64:
      return copy(H5T_STD_I64LE);
    case DType::kBool: {
      // h5py's bool: an enum over int8 with FALSE = 0 and TRUE = 1.
      UCP_ASSIGN_OR_RETURN(Handle t, Wrap(H5Tenum_create(H5T_STD_I8LE), H5Tclose,
                                          StatusCode::kInternal, "H5Tenum_create"));
      int8_t f = 0, tr = 1;
      if (H5Tenum_insert(t.get(), "FALSE", &f) < 0 || H5Tenum_insert(t.get(), "TRUE", &tr) < 0) {
        return H5Error(StatusCode::kInternal, "cannot build the bool hdf5 enum");
      }
      return t;
    }
  }
  return InternalError("unhandled dtype");
}

// A short description of a stored type for messages: "16-bit unsigned integer".
std::string DescribeType(hid_t t) {
  const size_t bits = H5Tget_size(t) * 8;
  switch (H5Tget_class(t)) {
    case H5T_FLOAT:
      return std::to_string(bits) + "-bit float";
    case H5T_INTEGER:
      return std::to_string(bits) + "-bit " +
             (H5Tget_sign(t) == H5T_SGN_NONE ? "unsigned" : "signed") + " integer";
    case H5T_ENUM:
      return std::to_string(bits) + "-bit enum";
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    default:
      return "type of class " + std::to_string(static_cast<int>(H5Tget_class(t)));
  }
}

bool IsHalf(hid_t t) {
  size_t spos, epos, esize, mpos, msize;
  if (H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize) < 0) return false;
  return H5Tget_size(t) == 2 && esize == 5 && msize == 10 && H5Tget_ebias(t) == 15;
}

bool IsBoolEnum(hid_t t) {
  if (H5Tget_class(t) != H5T_ENUM || H5Tget_size(t) != 1 || H5Tget_nmembers(t) != 2) return false;
  Handle super(H5Tget_super(t), H5Tclose);
  if (!super.valid() || H5Tget_sign(super.get()) != H5T_SGN_2) return false;
  int8_t v = -1;
  if (H5Tenum_valueof(t, "FALSE", &v) < 0 || v != 0) return false;
  if (H5Tenum_valueof(t, "TRUE", &v) < 0 || v != 1) return false;
  return true;
}

// Whether a stored type can hold dtype d (class, size and sign agree; byte order may differ).
bool TypeHolds(hid_t t, DType d) {
  const H5T_class_t cls = H5Tget_class(t);
  const size_t size = H5Tget_size(t);
  switch (d) {
    case DType::kFp64:
      return cls == H5T_FLOAT && size == 8;
    case DType::kFp32:
      return cls == H5T_FLOAT && size == 4;
    case DType::kFp16:
      return cls == H5T_FLOAT && IsHalf(t);
    case DType::kBf16:
      return cls == H5T_INTEGER && size == 2 && H5Tget_sign(t) == H5T_SGN_NONE;
    case DType::kFp8E4m3:
    case DType::kFp8E5m2:
    case DType::kUint8:
      return cls == H5T_INTEGER && size == 1 && H5Tget_sign(t) == H5T_SGN_NONE;
    case DType::kInt8:
    case DType::kInt16:
    case DType::kInt32:
    case DType::kInt64:
      return cls == H5T_INTEGER && static_cast<int64_t>(size) == DTypeSizeBytes(d) &&
             H5Tget_sign(t) == H5T_SGN_2;
    case DType::kBool:
      return IsBoolEnum(t);
  }
  return false;
}

// The dtype a stored type means when there is no dtype attribute (files written by others).
Result<DType> InferDType(hid_t t, const std::string& what) {
  const H5T_class_t cls = H5Tget_class(t);
  const size_t size = H5Tget_size(t);
  if (cls == H5T_FLOAT) {
    if (size == 8) return DType::kFp64;
    if (size == 4) return DType::kFp32;
    if (IsHalf(t)) return DType::kFp16;
  } else if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(t) == H5T_SGN_2;
    if (is_signed && size == 1) return DType::kInt8;
    if (is_signed && size == 2) return DType::kInt16;
    if (is_signed && size == 4) return DType::kInt32;
    if (is_signed && size == 8) return DType::kInt64;
    if (!is_signed && size == 1) return DType::kUint8;
  } else if (IsBoolEnum(t)) {
    return DType::kBool;
  }
  return UnimplementedError(what + " stores a " + DescribeType(t) +
                            ", which maps to no ucp dtype without a dtype attribute");
}

// ---- Names --------------------------------------------------------------------------------

Status ValidateObjectName(std::string_view name, const std::string& what) {
  if (name.empty() || name.front() == '/' || name.back() == '/' ||
      name.find("//") != std::string_view::npos || name.find('\0') != std::string_view::npos) {
    return InvalidArgumentError(what + " name '" + std::string(name) +
                                "' is not a relative hdf5 path like 'a' or 'a/b'");
  }
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = std::min(name.find('/', start), name.size());
    std::string_view part = name.substr(start, end - start);
    if (part == "." || part == "..") {
      return InvalidArgumentError(what + " name '" + std::string(name) +
                                  "' has a '.' or '..' component");
    }
    start = end + 1;
  }
  return Status::Ok();
}

// "" means the root group.
std::string ObjectPath(std::string_view object) {
  return object.empty() ? std::string(".") : std::string(object);
}

// Whether every link on the way to `name` exists (H5Lexists needs each parent to exist).
bool LinkExists(hid_t file, std::string_view name) {
  size_t pos = 0;
  while (true) {
    size_t slash = name.find('/', pos);
    std::string prefix(name.substr(0, slash));
    htri_t e = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    if (e <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    if (slash == std::string_view::npos) return true;
    pos = slash + 1;
  }
}

// ---- Chunk geometry -----------------------------------------------------------------------

// Chunks are [1, .., 1, k, d_{j+1}, .., d_n]: each is one contiguous byte range of the C-order
// tensor, so a chunk is a slice of the caller's buffer. Edge chunks (along dim j) are padded.
struct ChunkGrid {
  Shape dims;
  Shape chunk;
  int split_dim = 0;
  int64_t k = 1;
  int64_t per_split = 1;    // chunks along split_dim
  int64_t count = 0;        // total chunks
  int64_t inner_elems = 1;  // elements after split_dim
  int64_t chunk_elems = 0;  // elements per (full) chunk
  int64_t element_bytes = 0;

  static ChunkGrid Make(const Shape& dims, int64_t element_bytes, int64_t chunk_bytes) {
    ChunkGrid g;
    g.dims = dims;
    g.element_bytes = element_bytes;
    const int n = static_cast<int>(dims.size());
    std::vector<int64_t> inner(n + 1, 1);  // inner[j] = prod(dims[j..n-1])
    for (int j = n - 1; j >= 0; --j) inner[j] = inner[j + 1] * dims[j];
    int j = 0;
    while (j < n - 1 && inner[j + 1] * element_bytes > chunk_bytes) ++j;
    g.split_dim = j;
    g.inner_elems = inner[j + 1];
    g.k = std::clamp<int64_t>(chunk_bytes / (g.inner_elems * element_bytes), 1, dims[j]);
    g.chunk.assign(n, 1);
    g.chunk[j] = g.k;
    for (int i = j + 1; i < n; ++i) g.chunk[i] = dims[i];
    g.per_split = CeilDiv(dims[j], g.k);
    g.count = g.per_split * (NumElementsOrDie(dims) / inner[j]);
    g.chunk_elems = g.k * g.inner_elems;
    return g;
  }

  // Element offset of chunk i in dataset coordinates and in the flattening, and its valid length.
  void Locate(int64_t i, std::vector<hsize_t>& offset, int64_t& flat_begin,
              int64_t& valid_elems) const {
    const int n = static_cast<int>(dims.size());
    int64_t outer = i / per_split;
    const int64_t m = i % per_split;
    offset.assign(n, 0);
    for (int d = split_dim - 1; d >= 0; --d) {
      offset[d] = static_cast<hsize_t>(outer % dims[d]);
      outer /= dims[d];
    }
    offset[split_dim] = static_cast<hsize_t>(m * k);
    int64_t outer_index = i / per_split;
    flat_begin = outer_index * dims[split_dim] * inner_elems + m * k * inner_elems;
    valid_elems = std::min(k, dims[split_dim] - m * k) * inner_elems;
  }
};

// Bounds the memory of one batch of chunks in flight.
int64_t ChunksPerBatch(int64_t chunk_bytes) {
  const int64_t budget = std::max<int64_t>(int64_t{256} << 20, chunk_bytes);
  return std::max<int64_t>(1, budget / chunk_bytes);
}

// Splits the flat range [b, e) of a row-major `dims` array into boxes (start, count).
void FlatRangeBoxes(std::span<const int64_t> dims, int64_t b, int64_t e,
                    std::vector<hsize_t>& prefix,
                    std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>>& out) {
  if (b >= e) return;
  const size_t n = dims.size();
  auto emit = [&](std::vector<hsize_t> start, std::vector<hsize_t> count) {
    out.emplace_back(std::move(start), std::move(count));
  };
  if (n == 1) {
    std::vector<hsize_t> start = prefix, count(prefix.size(), 1);
    start.push_back(static_cast<hsize_t>(b));
    count.push_back(static_cast<hsize_t>(e - b));
    emit(std::move(start), std::move(count));
    return;
  }
  const int64_t inner = NumElementsOrDie(dims.subspan(1));
  auto rest = dims.subspan(1);
  auto recurse_row = [&](int64_t row, int64_t rb, int64_t re) {
    prefix.push_back(static_cast<hsize_t>(row));
    FlatRangeBoxes(rest, rb, re, prefix, out);
    prefix.pop_back();
  };
  int64_t r0 = b / inner;
  const int64_t r1 = e / inner;
  if (r0 == r1) {
    recurse_row(r0, b - r0 * inner, e - r0 * inner);
    return;
  }
  if (b % inner != 0) {
    recurse_row(r0, b % inner, inner);
    ++r0;
  }
  if (r1 > r0) {
    std::vector<hsize_t> start = prefix, count(prefix.size(), 1);
    start.push_back(static_cast<hsize_t>(r0));
    count.push_back(static_cast<hsize_t>(r1 - r0));
    for (size_t i = 1; i < n; ++i) {
      start.push_back(0);
      count.push_back(static_cast<hsize_t>(dims[i]));
    }
    emit(std::move(start), std::move(count));
  }
  if (e % inner != 0) recurse_row(r1, 0, e % inner);
}

}  // namespace

// ---- H5File -------------------------------------------------------------------------------

struct H5File::Impl {
  fs::path path;
  Handle file;
  bool writable = false;

  std::string Where(std::string_view dataset) const {
    return "dataset '" + std::string(dataset) + "' of " + path.string();
  }

  // Opens dataset `name`, kNotFound when absent.
  Result<Handle> OpenDataset(std::string_view name) const {
    std::string n(name);
    if (!LinkExists(file.get(), n)) return NotFoundError(Where(name) + " does not exist");
    UCP_ASSIGN_OR_RETURN(Handle d, Wrap(H5Dopen2(file.get(), n.c_str(), H5P_DEFAULT), H5Dclose,
                                        StatusCode::kDataLoss, "cannot open " + Where(name)));
    return d;
  }

  Result<DatasetMeta> Meta(hid_t dset, std::string_view name) const {
    DatasetMeta meta;
    UCP_ASSIGN_OR_RETURN(Handle type, Wrap(H5Dget_type(dset), H5Tclose, StatusCode::kDataLoss,
                                           "cannot read the type of " + Where(name)));
    UCP_ASSIGN_OR_RETURN(Handle space, Wrap(H5Dget_space(dset), H5Sclose, StatusCode::kDataLoss,
                                            "cannot read the dataspace of " + Where(name)));
    const int rank = H5Sget_simple_extent_ndims(space.get());
    if (rank < 0 || rank > kMaxRank) {
      return H5Error(StatusCode::kDataLoss, Where(name) + " has an unreadable rank");
    }
    if (H5Sget_simple_extent_type(space.get()) == H5S_NULL) {
      return DataLossError(Where(name) + " has a null dataspace (no shape)");
    }
    std::vector<hsize_t> dims(rank);
    if (H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr) < 0) {
      return H5Error(StatusCode::kDataLoss, "cannot read the dims of " + Where(name));
    }
    meta.shape.assign(dims.begin(), dims.end());
    UCP_RETURN_IF_ERROR(NumElements(meta.shape, Where(name)).status());
    const std::string attr_where = "attribute dtype of " + Where(name);
    if (H5Aexists(dset, std::string(kDTypeAttribute).c_str()) > 0) {
      UCP_ASSIGN_OR_RETURN(std::string dname,
                           ReadStringAttr(dset, ".", kDTypeAttribute, attr_where));
      auto d = DTypeFromName(dname);
      if (!d.ok()) return DataLossError(attr_where + " is '" + dname + "', not a ucp dtype name");
      if (!TypeHolds(type.get(), *d)) {
        return DataLossError(attr_where + " says " + dname + " but the dataset stores a " +
                             DescribeType(type.get()));
      }
      meta.dtype = *d;
    } else {
      H5Eclear2(H5E_DEFAULT);
      UCP_ASSIGN_OR_RETURN(meta.dtype, InferDType(type.get(), Where(name)));
    }
    UCP_ASSIGN_OR_RETURN(Handle dcpl,
                         Wrap(H5Dget_create_plist(dset), H5Pclose, StatusCode::kDataLoss,
                              "cannot read the creation properties of " + Where(name)));
    if (H5Pget_layout(dcpl.get()) == H5D_CHUNKED) {
      std::vector<hsize_t> chunk(rank);
      if (H5Pget_chunk(dcpl.get(), rank, chunk.data()) < 0) {
        return H5Error(StatusCode::kDataLoss, "cannot read the chunk shape of " + Where(name));
      }
      meta.chunk_shape.assign(chunk.begin(), chunk.end());
      const int nf = H5Pget_nfilters(dcpl.get());
      for (int i = 0; i < nf; ++i) {
        unsigned flags = 0, cfg = 0;
        size_t nelem = 0;
        if (H5Pget_filter2(dcpl.get(), static_cast<unsigned>(i), &flags, &nelem, nullptr, 0,
                           nullptr, &cfg) == kZstdFilterId) {
          meta.compressed = true;
        }
      }
    }
    return meta;
  }

  // The direct-chunk plan for a dataset: the pipeline must be [shuffle,] zstd, and the stored
  // type equal to the in-memory one (no conversion), else HDF5's own read path is used.
  struct DirectPlan {
    bool usable = false;
    int shuffle_index = -1;
    int zstd_index = -1;
  };
  DirectPlan PlanDirect(hid_t dset, hid_t dcpl, hid_t mem_type) const {
    DirectPlan p;
    Handle ftype(H5Dget_type(dset), H5Tclose);
    if (!ftype.valid() || H5Tequal(ftype.get(), mem_type) <= 0) return p;
    const int nf = H5Pget_nfilters(dcpl);
    for (int i = 0; i < nf; ++i) {
      unsigned flags = 0, cfg = 0;
      size_t nelem = 0;
      H5Z_filter_t id =
          H5Pget_filter2(dcpl, static_cast<unsigned>(i), &flags, &nelem, nullptr, 0, nullptr, &cfg);
      if (id == kShuffleId && i == 0)
        p.shuffle_index = i;
      else if (id == kZstdFilterId && p.zstd_index < 0)
        p.zstd_index = i;
      else
        return p;
    }
    p.usable = p.zstd_index >= 0;
    H5Eclear2(H5E_DEFAULT);
    return p;
  }

  static Result<std::string> ReadStringAttr(hid_t loc, const std::string& obj,
                                            std::string_view name, const std::string& what) {
    std::string n(name);
    if (H5Aexists_by_name(loc, obj.c_str(), n.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return NotFoundError(what + " does not exist");
    }
    UCP_ASSIGN_OR_RETURN(
        Handle attr, Wrap(H5Aopen_by_name(loc, obj.c_str(), n.c_str(), H5P_DEFAULT, H5P_DEFAULT),
                          H5Aclose, StatusCode::kDataLoss, "cannot open " + what));
    UCP_ASSIGN_OR_RETURN(Handle type, Wrap(H5Aget_type(attr.get()), H5Tclose, StatusCode::kDataLoss,
                                           "cannot read the type of " + what));
    if (H5Tget_class(type.get()) != H5T_STRING) {
      return DataLossError(what + " is a " + DescribeType(type.get()) + ", not a string");
    }
    Handle space(H5Aget_space(attr.get()), H5Sclose);
    if (!space.valid() || H5Sget_simple_extent_npoints(space.get()) != 1) {
      H5Eclear2(H5E_DEFAULT);
      return DataLossError(what + " is not a single string");
    }
    if (H5Tis_variable_str(type.get()) > 0) {
      UCP_ASSIGN_OR_RETURN(Handle mem,
                           Wrap(H5Tcopy(H5T_C_S1), H5Tclose, StatusCode::kInternal, "H5Tcopy"));
      H5Tset_size(mem.get(), H5T_VARIABLE);
      H5Tset_cset(mem.get(), H5Tget_cset(type.get()));
      char* s = nullptr;
      UCP_RETURN_IF_ERROR(
          Check(H5Aread(attr.get(), mem.get(), &s), StatusCode::kDataLoss, "cannot read " + what));
      std::string out = s ? std::string(s) : std::string();
      if (s) H5free_memory(s);
      return out;
    }
    const size_t size = H5Tget_size(type.get());
    std::string out(size, '\0');
    UCP_RETURN_IF_ERROR(Check(H5Aread(attr.get(), type.get(), out.data()), StatusCode::kDataLoss,
                              "cannot read " + what));
    out.resize(std::strlen(out.c_str()));
    return out;
  }

  Result<Handle> OpenAttr(std::string_view object, std::string_view name,
                          const std::string& what) const {
    const std::string obj = ObjectPath(object), n(name);
    if (!object.empty() && !LinkExists(file.get(), object)) {
      return NotFoundError("object '" + std::string(object) + "' of " + path.string() +
                           " does not exist");
    }
    if (H5Aexists_by_name(file.get(), obj.c_str(), n.c_str(), H5P_DEFAULT) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return NotFoundError(what + " does not exist");
    }
    return Wrap(H5Aopen_by_name(file.get(), obj.c_str(), n.c_str(), H5P_DEFAULT, H5P_DEFAULT),
                H5Aclose, StatusCode::kDataLoss, "cannot open " + what);
  }

  std::string AttrWhere(std::string_view object, std::string_view name) const {
    return "attribute '" + std::string(name) + "' of " +
           (object.empty() ? std::string("/") : "'" + std::string(object) + "'") + " in " +
           path.string();
  }

  Status CreateAttr(std::string_view object, std::string_view name, hid_t type, hid_t space,
                    const void* data) {
    const std::string what = AttrWhere(object, name);
    if (!writable) return FailedPreconditionError("cannot write " + what + ": file is read-only");
    const std::string obj = ObjectPath(object), n(name);
    if (!object.empty() && !LinkExists(file.get(), object)) {
      return NotFoundError("object '" + std::string(object) + "' of " + path.string() +
                           " does not exist");
    }
    if (H5Aexists_by_name(file.get(), obj.c_str(), n.c_str(), H5P_DEFAULT) > 0) {
      return AlreadyExistsError(what + " already exists");
    }
    H5Eclear2(H5E_DEFAULT);
    UCP_ASSIGN_OR_RETURN(Handle attr,
                         Wrap(H5Acreate_by_name(file.get(), obj.c_str(), n.c_str(), type, space,
                                                H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT),
                              H5Aclose, StatusCode::kIoError, "cannot create " + what));
    if (data == nullptr) return Status::Ok();  // a null dataspace holds no value
    return Check(H5Awrite(attr.get(), type, data), StatusCode::kIoError, "cannot write " + what);
  }

  Status EnsureParentGroups(std::string_view name) {
    size_t slash = name.find('/');
    while (slash != std::string_view::npos) {
      std::string prefix(name.substr(0, slash));
      htri_t e = H5Lexists(file.get(), prefix.c_str(), H5P_DEFAULT);
      if (e < 0) return H5Error(StatusCode::kIoError, "cannot look up group '" + prefix + "'");
      if (e == 0) {
        UCP_ASSIGN_OR_RETURN(Handle gcpl, Wrap(H5Pcreate(H5P_GROUP_CREATE), H5Pclose,
                                               StatusCode::kInternal, "H5Pcreate"));
        UCP_RETURN_IF_ERROR(Check(H5Pset_obj_track_times(gcpl.get(), false), StatusCode::kInternal,
                                  "H5Pset_obj_track_times"));
        UCP_ASSIGN_OR_RETURN(
            Handle g,
            Wrap(H5Gcreate2(file.get(), prefix.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT),
                 H5Gclose, StatusCode::kIoError,
                 "cannot create group '" + prefix + "' in " + path.string()));
      }
      slash = name.find('/', slash + 1);
    }
    return Status::Ok();
  }

  // What every new dataset starts from (under the lock): the file writable and the name free,
  // its parent groups, its storage type and dataspace, and creation properties with no
  // timestamps and no fill value writes (every byte gets written).
  struct NewDataset {
    Handle type, space, dcpl;
  };
  Result<NewDataset> PrepareDataset(std::string_view name, DType dtype, const Shape& shape) {
    if (!writable) {
      return FailedPreconditionError("cannot write " + Where(name) + ": file is read-only");
    }
    if (LinkExists(file.get(), name)) return AlreadyExistsError(Where(name) + " already exists");
    UCP_RETURN_IF_ERROR(EnsureParentGroups(name));
    NewDataset d;
    UCP_ASSIGN_OR_RETURN(d.type, StorageType(dtype));
    std::vector<hsize_t> dims(shape.begin(), shape.end());
    UCP_ASSIGN_OR_RETURN(
        d.space,
        Wrap(shape.empty() ? H5Screate(H5S_SCALAR)
                           : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
             H5Sclose, StatusCode::kInternal, "H5Screate"));
    UCP_ASSIGN_OR_RETURN(
        d.dcpl, Wrap(H5Pcreate(H5P_DATASET_CREATE), H5Pclose, StatusCode::kInternal, "H5Pcreate"));
    UCP_RETURN_IF_ERROR(Check(H5Pset_obj_track_times(d.dcpl.get(), false), StatusCode::kInternal,
                              "H5Pset_obj_track_times"));
    UCP_RETURN_IF_ERROR(Check(H5Pset_fill_time(d.dcpl.get(), H5D_FILL_TIME_NEVER),
                              StatusCode::kInternal, "H5Pset_fill_time"));
    return d;
  }

  // Creates the prepared dataset and its dtype attribute.
  Result<Handle> CreateDataset(std::string_view name, DType dtype, const NewDataset& d) {
    std::string n(name);
    UCP_ASSIGN_OR_RETURN(Handle dset,
                         Wrap(H5Dcreate2(file.get(), n.c_str(), d.type.get(), d.space.get(),
                                         H5P_DEFAULT, d.dcpl.get(), H5P_DEFAULT),
                              H5Dclose, StatusCode::kIoError, "cannot create " + Where(name)));
    UCP_RETURN_IF_ERROR(StringAttr(name, kDTypeAttribute, DTypeName(dtype)));
    return dset;
  }

  // A variable-length UTF-8 string attribute (h5py reads a `str`).
  Status StringAttr(std::string_view object, std::string_view name, std::string_view value) {
    UCP_ASSIGN_OR_RETURN(Handle type,
                         Wrap(H5Tcopy(H5T_C_S1), H5Tclose, StatusCode::kInternal, "H5Tcopy"));
    UCP_RETURN_IF_ERROR(
        Check(H5Tset_size(type.get(), H5T_VARIABLE), StatusCode::kInternal, "H5Tset_size"));
    UCP_RETURN_IF_ERROR(
        Check(H5Tset_cset(type.get(), H5T_CSET_UTF8), StatusCode::kInternal, "H5Tset_cset"));
    UCP_ASSIGN_OR_RETURN(Handle space,
                         Wrap(H5Screate(H5S_SCALAR), H5Sclose, StatusCode::kInternal, "H5Screate"));
    std::string v(value);
    const char* p = v.c_str();
    return CreateAttr(object, name, type.get(), space.get(), &p);
  }

  Status WriteCompressed(hid_t dset, const ConstTensorView& data, const ChunkGrid& g, int level) {
    const auto elem = static_cast<size_t>(g.element_bytes);
    const auto chunk_raw = static_cast<size_t>(g.chunk_elems) * elem;
    const int64_t batch = ChunksPerBatch(static_cast<int64_t>(chunk_raw));
    struct Out {
      std::vector<std::byte> frame;
      size_t size = 0;
      std::vector<hsize_t> offset;
      Status status;
    };
    std::vector<Out> outs;
    for (int64_t first = 0; first < g.count; first += batch) {
      const int64_t last = std::min(g.count, first + batch);
      outs.assign(static_cast<size_t>(last - first), Out{});
      // Parallel: slice, pad the edge chunk, shuffle and compress, with no HDF5 call.
      tbb::this_task_arena::isolate([&] {
        tbb::parallel_for(first, last, [&](int64_t i) {
          Out& o = outs[static_cast<size_t>(i - first)];
          int64_t flat_begin = 0, valid = 0;
          g.Locate(i, o.offset, flat_begin, valid);
          std::vector<std::byte> padded(chunk_raw, std::byte{0});
          std::memcpy(padded.data(), data.bytes.data() + flat_begin * g.element_bytes,
                      static_cast<size_t>(valid) * elem);
          std::vector<std::byte> shuffled(chunk_raw);
          ByteShuffle(padded, shuffled, elem);
          o.frame.resize(ZstdCompressBound(chunk_raw));
          auto n = ZstdCompress(shuffled, o.frame, level);
          if (!n.ok()) {
            o.status = n.status();
            return;
          }
          o.size = *n;
        });
      });
      Hdf5Lock lock;
      for (Out& o : outs) {
        UCP_RETURN_IF_ERROR(o.status);
        UCP_RETURN_IF_ERROR(
            Check(H5Dwrite_chunk(dset, H5P_DEFAULT, 0, o.offset.data(), o.size, o.frame.data()),
                  StatusCode::kIoError, "cannot write a chunk"));
      }
    }
    return Status::Ok();
  }

  Status ReadDirect(hid_t dset, const DirectPlan& plan, const ChunkGrid& g, TensorView out,
                    std::string_view name) const {
    const auto elem = static_cast<size_t>(g.element_bytes);
    const auto chunk_raw = static_cast<size_t>(g.chunk_elems) * elem;
    const int64_t batch = ChunksPerBatch(static_cast<int64_t>(chunk_raw));
    struct In {
      std::vector<std::byte> stored;
      uint32_t mask = 0;
      std::vector<hsize_t> offset;
      int64_t flat_begin = 0, valid = 0;
      Status status;
    };
    std::vector<In> ins;
    for (int64_t first = 0; first < g.count; first += batch) {
      const int64_t last = std::min(g.count, first + batch);
      ins.assign(static_cast<size_t>(last - first), In{});
      {
        Hdf5Lock lock;
        for (int64_t i = first; i < last; ++i) {
          In& in = ins[static_cast<size_t>(i - first)];
          g.Locate(i, in.offset, in.flat_begin, in.valid);
          hsize_t nbytes = 0;
          if (H5Dget_chunk_storage_size(dset, in.offset.data(), &nbytes) < 0 || nbytes == 0) {
            H5Eclear2(H5E_DEFAULT);
            return DataLossError(Where(name) + ": chunk " + std::to_string(i) + " of " +
                                 std::to_string(g.count) + " is missing");
          }
          if (nbytes > (uint64_t{1} << 32)) {
            return DataLossError(Where(name) + ": chunk " + std::to_string(i) + " claims " +
                                 std::to_string(nbytes) + " bytes");
          }
          in.stored.resize(nbytes);
          UCP_RETURN_IF_ERROR(
              Check(H5Dread_chunk(dset, H5P_DEFAULT, in.offset.data(), &in.mask, in.stored.data()),
                    StatusCode::kDataLoss,
                    "cannot read chunk " + std::to_string(i) + " of " + Where(name)));
        }
      }
      tbb::this_task_arena::isolate([&] {
        tbb::parallel_for(first, last, [&](int64_t i) {
          In& in = ins[static_cast<size_t>(i - first)];
          std::vector<std::byte> raw;
          const bool zstd_applied = (in.mask & (1u << plan.zstd_index)) == 0;
          if (zstd_applied) {
            raw.resize(chunk_raw);
            Status st = ZstdDecompress(in.stored, raw);
            if (!st.ok()) {
              in.status =
                  std::move(st).WithContext("in chunk " + std::to_string(i) + " of " + Where(name));
              return;
            }
          } else {
            raw = std::move(in.stored);
            if (raw.size() != chunk_raw) {
              in.status = DataLossError(Where(name) + ": raw chunk " + std::to_string(i) + " is " +
                                        std::to_string(raw.size()) + " bytes, expected " +
                                        std::to_string(chunk_raw));
              return;
            }
          }
          const bool shuffled =
              plan.shuffle_index >= 0 && (in.mask & (1u << plan.shuffle_index)) == 0;
          std::byte* dst = out.bytes.data() + in.flat_begin * g.element_bytes;
          const size_t valid_bytes = static_cast<size_t>(in.valid) * elem;
          if (shuffled) {
            std::vector<std::byte> plain(chunk_raw);
            ByteUnshuffle(raw, plain, elem);
            std::memcpy(dst, plain.data(), valid_bytes);
          } else {
            std::memcpy(dst, raw.data(), valid_bytes);
          }
        });
      });
      for (In& in : ins) UCP_RETURN_IF_ERROR(in.status);
    }
    return Status::Ok();
  }
};

H5File::H5File(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
H5File::H5File(H5File&&) noexcept = default;
H5File& H5File::operator=(H5File&& o) noexcept {
  if (this != &o) {
    if (impl_) {
      Hdf5Lock lock;
      impl_.reset();
    }
    impl_ = std::move(o.impl_);
  }
  return *this;
}
H5File::~H5File() {
  if (impl_) {
    Hdf5Lock lock;
    impl_.reset();
  }
}

const fs::path& H5File::path() const { return impl_->path; }

Result<H5File> H5File::Create(const fs::path& path) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(path, ec))) {
    return AlreadyExistsError("hdf5 file " + path.string() + " already exists");
  }
  Hdf5Lock lock;
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->writable = true;
  UCP_ASSIGN_OR_RETURN(
      Handle fcpl, Wrap(H5Pcreate(H5P_FILE_CREATE), H5Pclose, StatusCode::kInternal, "H5Pcreate"));
  UCP_ASSIGN_OR_RETURN(
      Handle fapl, Wrap(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, StatusCode::kInternal, "H5Pcreate"));
  // Pinned so the bytes do not depend on the library's defaults: the 1.10 format both ways
  // (needs a >= 1.10 reader, as every current h5py is), and no timestamps on the root group.
  UCP_RETURN_IF_ERROR(Check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V110, H5F_LIBVER_V110),
                            StatusCode::kInternal, "H5Pset_libver_bounds"));
  UCP_RETURN_IF_ERROR(Check(H5Pset_obj_track_times(fcpl.get(), false), StatusCode::kInternal,
                            "H5Pset_obj_track_times"));
  errno = 0;
  const hid_t created = H5Fcreate(path.c_str(), H5F_ACC_EXCL, fcpl.get(), fapl.get());
  if (created < 0 && IsResourceErrno(errno)) {
    // HDF5 hides errno in its message: a limit (EMFILE under a low `ulimit -n`) is a limit.
    const int e = errno;
    H5Eclear2(H5E_DEFAULT);
    return OsError("cannot create hdf5 file " + path.string(), e);
  }
  UCP_ASSIGN_OR_RETURN(impl->file, Wrap(created, H5Fclose, StatusCode::kIoError,
                                        "cannot create hdf5 file " + path.string()));
  return H5File(std::move(impl));
}

Result<H5File> H5File::Open(const fs::path& path) {
  std::error_code ec;
  // HDF5 hides errno: a file it cannot open (EMFILE under a low `ulimit -n`, ENOMEM) would read
  // as "not an hdf5 file". Open it ourselves first, without blocking on a FIFO, so that limits
  // are reported as limits and special files are refused before HDF5 sees them.
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      const int e = errno;
      if (e == ENOENT) return NotFoundError("hdf5 file " + path.string() + " does not exist");
      return OsError("cannot open hdf5 file " + path.string(), e);
    }
    struct stat st {};
    const int rc = ::fstat(fd, &st);
    const int e = errno;
    ::close(fd);
    if (rc != 0) return OsError("cannot stat hdf5 file " + path.string(), e);
    if (!S_ISREG(st.st_mode)) return IoError(path.string() + " is not a regular file");
  }
  Hdf5Lock lock;
  errno = 0;
  htri_t is = H5Fis_hdf5(path.c_str());
  if (is < 0) {
    // Not "no signature" (that is 0): the library could not open or read the file.
    const int e = errno;
    H5Eclear2(H5E_DEFAULT);
    if (IsResourceErrno(e)) return OsError("cannot open hdf5 file " + path.string(), e);
    return IoError("cannot read hdf5 file " + path.string() +
                   (e != 0 ? std::string(": ") + std::strerror(e) : std::string()));
  }
  if (is == 0) {
    H5Eclear2(H5E_DEFAULT);
    return DataLossError("file " + path.string() + " (" + std::to_string(fs::file_size(path, ec)) +
                         " bytes) is not an hdf5 file: no hdf5 signature");
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  errno = 0;
  hid_t opened = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (opened < 0 && IsResourceErrno(errno)) {
    const int e = errno;
    H5Eclear2(H5E_DEFAULT);
    return OsError("cannot open hdf5 file " + path.string(), e);
  }
  UCP_ASSIGN_OR_RETURN(
      impl->file,
      Wrap(opened, H5Fclose, StatusCode::kDataLoss,
           "hdf5 file " + path.string() + " (" + std::to_string(fs::file_size(path, ec)) +
               " bytes) is truncated or corrupt"));
  return H5File(std::move(impl));
}

Status H5File::Close() {
  if (!impl_ || !impl_->file.valid()) return FailedPreconditionError("hdf5 file is already closed");
  Hdf5Lock lock;
  const std::string p = impl_->path.string();
  hid_t id = impl_->file.Release();
  if (impl_->writable && H5Fflush(id, H5F_SCOPE_LOCAL) < 0) {
    Status st = H5Error(StatusCode::kIoError, "cannot flush hdf5 file " + p);
    H5Fclose(id);
    return st;
  }
  return Check(H5Fclose(id), StatusCode::kIoError, "cannot close hdf5 file " + p);
}

Status H5File::WriteDataset(std::string_view name, const ConstTensorView& data,
                            const DatasetOptions& options) {
  UCP_RETURN_IF_ERROR(ValidateObjectName(name, "dataset"));
  UCP_RETURN_IF_ERROR(ValidateView(data, impl_->Where(name)));
  if (data.shape.size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgumentError(impl_->Where(name) + " has rank " +
                                std::to_string(data.shape.size()) + ", more than " +
                                std::to_string(kMaxRank));
  }
  const int64_t n = data.num_elements();
  const bool compress = options.compression_level != 0 && n > 0 && !data.shape.empty();
  if (options.compression_level != 0 &&
      (options.compression_level < ZstdMinLevel() || options.compression_level > ZstdMaxLevel())) {
    return InvalidArgumentError("compression_level " + std::to_string(options.compression_level) +
                                " for " + impl_->Where(name) + " is outside [" +
                                std::to_string(ZstdMinLevel()) + ", " +
                                std::to_string(ZstdMaxLevel()) + "]");
  }
  if (options.chunk_bytes < kMinChunkBytes || options.chunk_bytes > kMaxChunkBytes) {
    return InvalidArgumentError("chunk_bytes " + std::to_string(options.chunk_bytes) + " for " +
                                impl_->Where(name) + " is outside [4096, 1073741824]");
  }
  ChunkGrid grid;
  Handle dset;
  {
    Hdf5Lock lock;
    UCP_ASSIGN_OR_RETURN(Impl::NewDataset nd, impl_->PrepareDataset(name, data.dtype, data.shape));
    const Handle& dcpl = nd.dcpl;
    if (compress) {
      grid = ChunkGrid::Make(data.shape, DTypeSizeBytes(data.dtype), options.chunk_bytes);
      std::vector<hsize_t> chunk(grid.chunk.begin(), grid.chunk.end());
      const unsigned level = static_cast<unsigned>(options.compression_level);
      UCP_RETURN_IF_ERROR(
          Check(H5Pset_chunk(dcpl.get(), static_cast<int>(chunk.size()), chunk.data()),
                StatusCode::kInternal, "H5Pset_chunk"));
      UCP_RETURN_IF_ERROR(
          Check(H5Pset_shuffle(dcpl.get()), StatusCode::kInternal, "H5Pset_shuffle"));
      UCP_RETURN_IF_ERROR(
          Check(H5Pset_filter(dcpl.get(), kZstdFilterId, H5Z_FLAG_OPTIONAL, 1, &level),
                StatusCode::kInternal, "H5Pset_filter zstd"));
      // Chunks are written by us, all of them: allocating early would write fill space.
      UCP_RETURN_IF_ERROR(Check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_INCR),
                                StatusCode::kInternal, "H5Pset_alloc_time"));
    }
    UCP_ASSIGN_OR_RETURN(dset, impl_->CreateDataset(name, data.dtype, nd));
    if (!compress && n > 0) {
      UCP_RETURN_IF_ERROR(Check(
          H5Dwrite(dset.get(), nd.type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data.bytes.data()),
          StatusCode::kIoError, "cannot write " + impl_->Where(name)));
    }
  }
  if (compress) {
    UCP_RETURN_IF_ERROR(impl_->WriteCompressed(dset.get(), data, grid, options.compression_level),
                        "while writing " + impl_->Where(name));
  }
  Hdf5Lock lock;
  dset.Reset();
  return Status::Ok();
}

Result<int64_t> H5File::CreateDirectDataset(std::string_view name, DType dtype,
                                            const Shape& shape) {
  UCP_RETURN_IF_ERROR(ValidateObjectName(name, "dataset"));
  if (shape.size() > static_cast<size_t>(kMaxRank)) {
    return InvalidArgumentError(impl_->Where(name) + " has rank " + std::to_string(shape.size()) +
                                ", more than " + std::to_string(kMaxRank));
  }
  UCP_ASSIGN_OR_RETURN(int64_t n, NumElements(shape), impl_->Where(name));
  Hdf5Lock lock;
  UCP_ASSIGN_OR_RETURN(Impl::NewDataset nd, impl_->PrepareDataset(name, dtype, shape));
  UCP_RETURN_IF_ERROR(
      Check(H5Pset_layout(nd.dcpl.get(), H5D_CONTIGUOUS), StatusCode::kInternal, "H5Pset_layout"));
  // Early allocation gives the dataset its final place in the file now.
  UCP_RETURN_IF_ERROR(Check(H5Pset_alloc_time(nd.dcpl.get(), H5D_ALLOC_TIME_EARLY),
                            StatusCode::kInternal, "H5Pset_alloc_time"));
  UCP_ASSIGN_OR_RETURN(Handle dset, impl_->CreateDataset(name, dtype, nd));
  if (n == 0) return int64_t{-1};
  const haddr_t addr = H5Dget_offset(dset.get());
  if (addr == HADDR_UNDEF) {
    return H5Error(StatusCode::kIoError, "no storage was allocated for " + impl_->Where(name));
  }
  return static_cast<int64_t>(addr);
}

Result<int64_t> H5File::DirectOffset(std::string_view name) const {
  Hdf5Lock lock;
  UCP_ASSIGN_OR_RETURN(Handle dset, impl_->OpenDataset(name));
  UCP_ASSIGN_OR_RETURN(DatasetMeta meta, impl_->Meta(dset.get(), name));
  const int64_t n = NumElementsOrDie(meta.shape);
  if (n == 0 || !meta.chunk_shape.empty()) return int64_t{-1};
  UCP_ASSIGN_OR_RETURN(Handle dcpl, Wrap(H5Dget_create_plist(dset.get()), H5Pclose,
                                         StatusCode::kDataLoss, "H5Dget_create_plist"));
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS || H5Pget_nfilters(dcpl.get()) != 0 ||
      H5Pget_external_count(dcpl.get()) != 0) {
    H5Eclear2(H5E_DEFAULT);
    return int64_t{-1};
  }
  const haddr_t addr = H5Dget_offset(dset.get());
  if (addr == HADDR_UNDEF) {
    H5Eclear2(H5E_DEFAULT);
    return int64_t{-1};
  }
  const hsize_t stored = H5Dget_storage_size(dset.get());
  if (stored != static_cast<hsize_t>(n * DTypeSizeBytes(meta.dtype))) {
    return DataLossError(impl_->Where(name) + " stores " + std::to_string(stored) + " bytes for " +
                         std::to_string(n) + " elements of " + std::string(DTypeName(meta.dtype)));
  }
  // Readers pread these bytes straight from the file: they must all be in it.
  std::error_code ec;
  const uint64_t file_bytes = fs::file_size(impl_->path, ec);
  if (ec) return IoError("cannot stat " + impl_->path.string() + ": " + ec.message());
  if (addr + stored > file_bytes) {
    return DataLossError(impl_->Where(name) + ": data at bytes [" + std::to_string(addr) + ", " +
                         std::to_string(addr + stored) + ") is past the end of the " +
                         std::to_string(file_bytes) + "-byte file: truncated");
  }
  return static_cast<int64_t>(addr);
}

Result<DatasetMeta> H5File::DatasetInfo(std::string_view name) const {
  Hdf5Lock lock;
  UCP_ASSIGN_OR_RETURN(Handle dset, impl_->OpenDataset(name));
  return impl_->Meta(dset.get(), name);
}

bool H5File::HasDataset(std::string_view name) const {
  Hdf5Lock lock;
  if (!LinkExists(impl_->file.get(), name)) return false;
  std::string n(name);
  Handle obj(H5Oopen(impl_->file.get(), n.c_str(), H5P_DEFAULT), H5Oclose);
  if (!obj.valid()) {
    H5Eclear2(H5E_DEFAULT);
    return false;
  }
  return H5Iget_type(obj.get()) == H5I_DATASET;
}

namespace {
herr_t CollectLink(hid_t, const char* name, const H5L_info_t* info, void* data) {
  auto* out = static_cast<std::vector<std::pair<std::string, bool>>*>(data);
  out->emplace_back(name, info->type == H5L_TYPE_HARD);
  return 0;
}
}  // namespace

Result<std::vector<std::string>> H5File::ListDatasets() const {
  Hdf5Lock lock;
  std::vector<std::pair<std::string, bool>> links;
  UCP_RETURN_IF_ERROR(
      // Native order (sorted below): an ordered visit of a large group builds a table of its
      // links, and HDF5 1.10 frees that table's unfilled entries when building it fails on
      // corrupt metadata (valgrind: invalid free in H5G__link_release_table; a segfault now
      // and then), where a failure must be a clean data_loss.
      Check(H5Lvisit(impl_->file.get(), H5_INDEX_NAME, H5_ITER_NATIVE, CollectLink, &links),
            StatusCode::kDataLoss, "cannot list the objects of " + impl_->path.string()));
  std::vector<std::string> out;
  for (const auto& [name, hard] : links) {
    if (!hard) continue;
    Handle obj(H5Oopen(impl_->file.get(), name.c_str(), H5P_DEFAULT), H5Oclose);
    if (!obj.valid()) {
      return H5Error(StatusCode::kDataLoss,
                     "cannot open object '" + name + "' of " + impl_->path.string());
    }
    if (H5Iget_type(obj.get()) == H5I_DATASET) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<Tensor> H5File::ReadDataset(std::string_view name) const {
  UCP_ASSIGN_OR_RETURN(DatasetMeta meta, DatasetInfo(name));
  UCP_ASSIGN_OR_RETURN(Tensor t, Tensor::Zeros(meta.dtype, meta.shape),
                       "while reading " + impl_->Where(name));
  UCP_RETURN_IF_ERROR(ReadDatasetInto(name, t.view()));
  return t;
}

Status H5File::ReadDatasetInto(std::string_view name, TensorView out) const {
  UCP_RETURN_IF_ERROR(ValidateView(out, "output for " + impl_->Where(name)));
  Handle dset;
  ChunkGrid grid;
  Impl::DirectPlan plan;
  {
    Hdf5Lock lock;
    UCP_ASSIGN_OR_RETURN(dset, impl_->OpenDataset(name));
    UCP_ASSIGN_OR_RETURN(DatasetMeta meta, impl_->Meta(dset.get(), name));
    if (meta.dtype != out.dtype || meta.shape != out.shape) {
      return InvalidArgumentError(impl_->Where(name) + " is " + std::string(DTypeName(meta.dtype)) +
                                  " " + ShapeToString(meta.shape) + " but the output is " +
                                  std::string(DTypeName(out.dtype)) + " " +
                                  ShapeToString(out.shape));
    }
    if (out.bytes.empty()) return Status::Ok();
    UCP_ASSIGN_OR_RETURN(Handle mem_type, StorageType(meta.dtype));
    if (!meta.chunk_shape.empty() && meta.compressed) {
      UCP_ASSIGN_OR_RETURN(Handle dcpl, Wrap(H5Dget_create_plist(dset.get()), H5Pclose,
                                             StatusCode::kDataLoss, "H5Dget_create_plist"));
      plan = impl_->PlanDirect(dset.get(), dcpl.get(), mem_type.get());
      if (plan.usable) {
        const int64_t chunk_bytes = NumElementsOrDie(meta.chunk_shape) * DTypeSizeBytes(meta.dtype);
        grid = ChunkGrid::Make(meta.shape, DTypeSizeBytes(meta.dtype), chunk_bytes);
        // Only our own chunk geometry can be read chunk by chunk as contiguous slices.
        if (grid.chunk != meta.chunk_shape) plan.usable = false;
      }
    }
    if (!plan.usable) {
      return Check(
          H5Dread(dset.get(), mem_type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.bytes.data()),
          StatusCode::kDataLoss, "cannot read " + impl_->Where(name));
    }
  }
  Status st = impl_->ReadDirect(dset.get(), plan, grid, out, name);
  Hdf5Lock lock;
  dset.Reset();
  return st;
}

Status H5File::ReadFlatRange(std::string_view name, int64_t begin_elem, int64_t end_elem,
                             std::span<std::byte> out) const {
  Hdf5Lock lock;
  UCP_ASSIGN_OR_RETURN(Handle dset, impl_->OpenDataset(name));
  UCP_ASSIGN_OR_RETURN(DatasetMeta meta, impl_->Meta(dset.get(), name));
  const int64_t n = NumElementsOrDie(meta.shape);
  if (begin_elem < 0 || end_elem < begin_elem || end_elem > n) {
    return OutOfRangeError("element range [" + std::to_string(begin_elem) + ", " +
                           std::to_string(end_elem) + ") is outside " + impl_->Where(name) +
                           " of " + std::to_string(n) + " elements");
  }
  const int64_t want = (end_elem - begin_elem) * DTypeSizeBytes(meta.dtype);
  if (static_cast<int64_t>(out.size()) != want) {
    return InvalidArgumentError("output for range [" + std::to_string(begin_elem) + ", " +
                                std::to_string(end_elem) + ") of " + impl_->Where(name) + " is " +
                                std::to_string(out.size()) + " bytes, expected " +
                                std::to_string(want));
  }
  if (want == 0) return Status::Ok();
  UCP_ASSIGN_OR_RETURN(Handle mem_type, StorageType(meta.dtype));
  if (meta.shape.empty()) {
    return Check(H5Dread(dset.get(), mem_type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()),
                 StatusCode::kDataLoss, "cannot read " + impl_->Where(name));
  }
  UCP_ASSIGN_OR_RETURN(Handle fspace, Wrap(H5Dget_space(dset.get()), H5Sclose,
                                           StatusCode::kDataLoss, "H5Dget_space"));
  std::vector<hsize_t> prefix;
  std::vector<std::pair<std::vector<hsize_t>, std::vector<hsize_t>>> boxes;
  FlatRangeBoxes(meta.shape, begin_elem, end_elem, prefix, boxes);
  for (size_t i = 0; i < boxes.size(); ++i) {
    UCP_RETURN_IF_ERROR(
        Check(H5Sselect_hyperslab(fspace.get(), i == 0 ? H5S_SELECT_SET : H5S_SELECT_OR,
                                  boxes[i].first.data(), nullptr, boxes[i].second.data(), nullptr),
              StatusCode::kInternal, "H5Sselect_hyperslab"));
  }
  hsize_t count = static_cast<hsize_t>(end_elem - begin_elem);
  UCP_ASSIGN_OR_RETURN(Handle mspace, Wrap(H5Screate_simple(1, &count, nullptr), H5Sclose,
                                           StatusCode::kInternal, "H5Screate_simple"));
  return Check(
      H5Dread(dset.get(), mem_type.get(), mspace.get(), fspace.get(), H5P_DEFAULT, out.data()),
      StatusCode::kDataLoss,
      "cannot read elements [" + std::to_string(begin_elem) + ", " + std::to_string(end_elem) +
          ") of " + impl_->Where(name));
}

Status H5File::WriteStringAttribute(std::string_view object, std::string_view name,
                                    std::string_view value) {
  Hdf5Lock lock;
  return impl_->StringAttr(object, name, value);
}

Status H5File::WriteInt64Attribute(std::string_view object, std::string_view name, int64_t value) {
  Hdf5Lock lock;
  UCP_ASSIGN_OR_RETURN(Handle space,
                       Wrap(H5Screate(H5S_SCALAR), H5Sclose, StatusCode::kInternal, "H5Screate"));
  return impl_->CreateAttr(object, name, H5T_STD_I64LE, space.get(), &value);
}

Status H5File::WriteInt64ArrayAttribute(std::string_view object, std::string_view name,
                                        std::span<const int64_t> values) {
  Hdf5Lock lock;
  hsize_t n = values.size();
  UCP_ASSIGN_OR_RETURN(
      Handle space, Wrap(n == 0 ? H5Screate(H5S_NULL) : H5Screate_simple(1, &n, nullptr), H5Sclose,
                         StatusCode::kInternal, "H5Screate"));
  return impl_->CreateAttr(object, name, H5T_STD_I64LE, space.get(), values.data());
}

Result<std::string> H5File::ReadStringAttribute(std::string_view object,
                                                std::string_view name) const {
  Hdf5Lock lock;
  const std::string what = impl_->AttrWhere(object, name);
  if (!object.empty() && !LinkExists(impl_->file.get(), object)) {
    return NotFoundError("object '" + std::string(object) + "' of " + impl_->path.string() +
                         " does not exist");
  }
  return Impl::ReadStringAttr(impl_->file.get(), ObjectPath(object), name, what);
}

Result<int64_t> H5File::ReadInt64Attribute(std::string_view object, std::string_view name) const {
  Hdf5Lock lock;
  const std::string what = impl_->AttrWhere(object, name);
  UCP_ASSIGN_OR_RETURN(Handle attr, impl_->OpenAttr(object, name, what));
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  if (!type.valid() || !space.valid() || H5Tget_class(type.get()) != H5T_INTEGER ||
      H5Sget_simple_extent_type(space.get()) != H5S_SCALAR) {
    H5Eclear2(H5E_DEFAULT);
    return DataLossError(what + " is not a scalar integer");
  }
  int64_t v = 0;
  UCP_RETURN_IF_ERROR(Check(H5Aread(attr.get(), H5T_NATIVE_INT64, &v), StatusCode::kDataLoss,
                            "cannot read " + what));
  return v;
}

Result<std::vector<int64_t>> H5File::ReadInt64ArrayAttribute(std::string_view object,
                                                             std::string_view name) const {
  Hdf5Lock lock;
  const std::string what = impl_->AttrWhere(object, name);
  UCP_ASSIGN_OR_RETURN(Handle attr, impl_->OpenAttr(object, name, what));
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  Handle space(H5Aget_space(attr.get()), H5Sclose);
  if (!type.valid() || !space.valid() || H5Tget_class(type.get()) != H5T_INTEGER) {
    H5Eclear2(H5E_DEFAULT);
    return DataLossError(what + " is not an integer array");
  }
  const H5S_class_t cls = H5Sget_simple_extent_type(space.get());
  if (cls == H5S_NULL) return std::vector<int64_t>{};
  if (cls != H5S_SIMPLE || H5Sget_simple_extent_ndims(space.get()) != 1) {
    return DataLossError(what + " is not a one-dimensional integer array");
  }
  const hssize_t n = H5Sget_simple_extent_npoints(space.get());
  if (n < 0 || n > (1 << 20)) return DataLossError(what + " has an unreasonable length");
  std::vector<int64_t> v(static_cast<size_t>(n));
  UCP_RETURN_IF_ERROR(Check(H5Aread(attr.get(), H5T_NATIVE_INT64, v.data()), StatusCode::kDataLoss,
                            "cannot read " + what));
  return v;
}

bool H5File::HasAttribute(std::string_view object, std::string_view name) const {
  Hdf5Lock lock;
  if (!object.empty() && !LinkExists(impl_->file.get(), object)) return false;
  const std::string obj = ObjectPath(object), n(name);
  htri_t e = H5Aexists_by_name(impl_->file.get(), obj.c_str(), n.c_str(), H5P_DEFAULT);
  if (e < 0) H5Eclear2(H5E_DEFAULT);
  return e > 0;
}

bool Hdf5IsThreadSafe() {
  hbool_t ts = false;
  H5is_library_threadsafe(&ts);
  return ts;
}

}  // namespace ucp::io
