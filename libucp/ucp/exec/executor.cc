// Executor: ops clipped to windows of a target, gathers that read a row or a flat span at a
// time, per-thread reusable buffers, a byte budget, and oneTBB over targets.
#include "ucp/exec/executor.h"

#include <sys/resource.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>

#include "ucp/base/progress.h"
#include "ucp/base/status_macros.h"
#include "ucp/tensor/cast.h"

namespace ucp::exec {

using convert::Op;
using convert::OpKind;
using convert::Plan;
using convert::StridedRef;
using convert::TensorInfo;

namespace {

constexpr int64_t kMinWindowBytes = int64_t{64} << 10;
// A window is read into, checksummed (the source's read verification) and written out of
// while it is still in the core's cache: a window of 4 MiB or more falls out of it between those
// passes and the kernel's copy into the page cache alone then costs 3-4x its CPU time (sys time
// of `ucp extract` of GPT-2 small: 0.5 s at 1-2 MiB windows, 1.9 s at 4 MiB, 2.2 s at 8 MiB;
// docs/PERFORMANCE.md, "DeepSpeed extraction").
constexpr int64_t kMaxWindowBytes = int64_t{1} << 20;
// A gather reads a source span in one call when the box fills at least 1/kSpanDensity of it and
// the span fits kSpanReadBytes; otherwise row by row. Copying the gaps from the page cache costs
// about what a syscall per short row does (a tp=4 column slice: 3x the bytes, 1/rows the calls;
// measured on the resharding benchmark, docs/PERFORMANCE.md).
constexpr int64_t kSpanReadBytes = int64_t{4} << 20;
constexpr int64_t kSpanDensity = 4;
// Rows at least this long are read on their own even inside a dense span.
constexpr int64_t kLongRowBytes = int64_t{64} << 10;
// Elements per block when a check or an average works through a box.
constexpr int64_t kBlockElems = int64_t{1} << 18;

// Counts the bytes alive in buffers and blocks a new buffer while the budget is spent. One
// request larger than the budget runs when nothing else is in flight, so progress is assured.
class ByteBudget {
 public:
  explicit ByteBudget(int64_t limit) : limit_(limit) {}
  void Acquire(int64_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return limit_ <= 0 || used_ == 0 || used_ + n <= limit_; });
    used_ += n;
    peak_ = std::max(peak_, used_);
  }
  void Release(int64_t n) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      used_ -= n;
    }
    cv_.notify_all();
  }
  int64_t peak() const { return peak_; }

 private:
  int64_t limit_;
  int64_t used_ = 0;
  int64_t peak_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Reusable memory of one worker thread, grown on demand: page faults and zeroing happen once per
// thread, not once per tensor.
struct Scratch {
  HostBuffer window;  // the target window being built
  HostBuffer read;    // raw source bytes
  HostBuffer cast;    // cast or packed rows
  HostBuffer accum;   // fp64 sums of an average
  HostBuffer other;   // the second box of a check
  HostBuffer row;     // a source row cast for a strided destination
  HostBuffer tile;    // kTileRows source rows of a transposed copy, packed (then cast)

  static Result<std::span<std::byte>> Get(HostBuffer& b, int64_t bytes) {
    if (b.num_bytes() < bytes) {
      b = HostBuffer();  // free first, so the peak is not old + new
      UCP_ASSIGN_OR_RETURN(b, HostBuffer::Allocate(bytes));
    }
    return std::span<std::byte>(b.data(), static_cast<size_t>(bytes));
  }
};

// n elements of `size` bytes from `from` (packed) to `to` every `stride` elements.
template <int64_t size>
void ScatterRow(const std::byte* from, int64_t n, std::byte* to, int64_t stride) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(to + i * stride * size, from + i * size, size);
}

// A transposed copy (HF's Conv1D weights) moves kTileRows source rows at a time: the tile, packed
// [rows, n], is stored column by column, so each destination write is kTileRows adjacent
// elements (a cache line of fp32) instead of one element per line as ScatterRow does.
constexpr int64_t kTileRows = 16;

// tile [rows, n] (packed, `size`-byte elements) to `to` [n, rows] with row stride `stride`.
template <int64_t size>
void TransposeTile(const std::byte* tile, int64_t rows, int64_t n, std::byte* to, int64_t stride) {
  for (int64_t j = 0; j < n; ++j) {
    std::byte* out = to + j * stride * size;
    const std::byte* in = tile + j * size;
    for (int64_t i = 0; i < rows; ++i) std::memcpy(out + i * size, in + i * n * size, size);
  }
}

// An op, or a part of one: a box of `counts` elements, where it goes and where it comes from.
struct Box {
  std::vector<int64_t> counts;
  StridedRef dst;
  std::vector<StridedRef> srcs;
};

int64_t SpanOf(const std::vector<int64_t>& counts, const std::vector<int64_t>& strides,
               size_t from_dim = 0) {
  int64_t hi = 0;
  for (size_t k = from_dim; k < counts.size(); ++k) hi += (counts[k] - 1) * strides[k];
  return hi + 1;
}

int64_t Elements(const std::vector<int64_t>& counts) {
  int64_t n = 1;
  for (int64_t c : counts) n *= c;
  return n;
}

int64_t CeilDiv(int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }

// The box without its first dimension, at index i of it.
Box Row(const Box& b, int64_t i) {
  Box r;
  r.counts.assign(b.counts.begin() + 1, b.counts.end());
  r.dst.tensor = b.dst.tensor;
  r.dst.offset = b.dst.offset;
  if (!b.dst.strides.empty()) {  // a check op has no destination
    r.dst.offset += i * b.dst.strides[0];
    r.dst.strides.assign(b.dst.strides.begin() + 1, b.dst.strides.end());
  }
  for (const StridedRef& s : b.srcs) {
    StridedRef t;
    t.tensor = s.tensor;
    t.offset = s.offset + i * s.strides[0];
    t.strides.assign(s.strides.begin() + 1, s.strides.end());
    r.srcs.push_back(std::move(t));
  }
  return r;
}

// Indices [i0, i1) of the box's first dimension.
Box Rows(const Box& b, int64_t i0, int64_t i1) {
  Box r = b;
  r.counts[0] = i1 - i0;
  if (!b.dst.strides.empty()) r.dst.offset += i0 * b.dst.strides[0];
  for (size_t k = 0; k < r.srcs.size(); ++k) r.srcs[k].offset += i0 * b.srcs[k].strides[0];
  return r;
}

// Indices [j0, j1) of a 2-d box's second dimension.
Box Cols(const Box& b, int64_t j0, int64_t j1) {
  Box r = b;
  r.counts[1] = j1 - j0;
  r.dst.offset += j0 * b.dst.strides[1];
  for (size_t k = 0; k < r.srcs.size(); ++k) r.srcs[k].offset += j0 * b.srcs[k].strides[1];
  return r;
}

// Appends to `out` the parts of box `b` whose destination elements lie in [a, e): every element
// of b in the window lands in exactly one part, and every part lies inside the window.
void Clip(const Box& b, int64_t a, int64_t e, std::vector<Box>& out) {
  const int64_t lo = b.dst.offset;
  if (b.counts.empty()) {
    if (lo >= a && lo < e) out.push_back(b);
    return;
  }
  if (Elements(b.counts) == 0) return;
  const int64_t hi = lo + SpanOf(b.counts, b.dst.strides);
  if (hi <= a || lo >= e) return;
  if (lo >= a && hi <= e) {
    out.push_back(b);
    return;
  }
  const int64_t c0 = b.counts[0];
  const int64_t d0 = b.dst.strides[0];
  if (b.counts.size() == 1) {
    if (d0 <= 0) {  // every element at the same place: only a degenerate single element
      if (c0 == 1 && lo >= a && lo < e) out.push_back(b);
      return;
    }
    const int64_t i0 = CeilDiv(a - lo, d0);
    const int64_t i1 = std::min(c0, CeilDiv(e - lo, d0));
    if (i0 < i1) out.push_back(Rows(b, i0, i1));
    return;
  }
  const int64_t rest = SpanOf(b.counts, b.dst.strides, 1);
  if (d0 < rest && b.counts.size() == 2 && b.dst.strides[1] >= (c0 - 1) * d0 + 1) {
    // A transpose (rows interleave, the columns do not): whole columns inside the window form
    // one box, so the gather keeps its tiles; at most the columns holding a and e - 1 are cut.
    const int64_t c1 = b.counts[1], d1 = b.dst.strides[1];
    const int64_t width = (c0 - 1) * d0 + 1;
    const int64_t first_full = std::min(c1, CeilDiv(a - lo, d1));
    const int64_t last_full = e - lo - width < 0 ? 0 : std::min(c1, (e - lo - width) / d1 + 1);
    if (first_full < last_full) out.push_back(Cols(b, first_full, last_full));
    std::set<int64_t> cut;
    if (a > lo) cut.insert(std::min(c1 - 1, (a - lo) / d1));
    if (e - 1 >= lo) cut.insert(std::min(c1 - 1, (e - 1 - lo) / d1));
    for (int64_t j : cut) {
      if (j >= first_full && j < last_full) continue;
      Clip(Cols(b, j, j + 1), a, e, out);
    }
    return;
  }
  if (d0 < rest) {
    // Rows interleave in the destination (no plan makes these): clip each row on its own.
    for (int64_t i = 0; i < c0; ++i) Clip(Row(b, i), a, e, out);
    return;
  }
  // Rows are ordered and disjoint: whole rows inside the window form one run; at most the rows
  // holding a and e - 1 are cut.
  const int64_t first_full = std::min(c0, CeilDiv(a - lo, d0));
  const int64_t last_full = e - lo - rest < 0 ? 0 : std::min(c0, (e - lo - rest) / d0 + 1);
  if (first_full < last_full) out.push_back(Rows(b, first_full, last_full));
  std::set<int64_t> cut;
  if (a > lo) cut.insert(std::min(c0 - 1, (a - lo) / d0));
  if (e - 1 >= lo) cut.insert(std::min(c0 - 1, (e - 1 - lo) / d0));
  for (int64_t i : cut) {
    if (i >= first_full && i < last_full) continue;
    Clip(Row(b, i), a, e, out);
  }
}

// Calls fn(row, src_offset, dst_offset) for every row (the last dimension) of a box with one
// source, in row-major order.
template <typename Fn>
void ForEachRow(const std::vector<int64_t>& counts, const StridedRef& src, const StridedRef& dst,
                Fn fn) {
  const size_t nd = counts.size();
  if (nd <= 1) {
    fn(int64_t{0}, src.offset, dst.offset);
    return;
  }
  std::vector<int64_t> idx(nd - 1, 0);
  int64_t row = 0;
  while (true) {
    int64_t so = src.offset, dof = dst.offset;
    for (size_t k = 0; k + 1 < nd; ++k) {
      so += idx[k] * src.strides[k];
      dof += idx[k] * dst.strides[k];
    }
    fn(row++, so, dof);
    size_t k = nd - 1;
    while (k > 0) {
      --k;
      if (++idx[k] < counts[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
  }
}

Status CheckRef(const StridedRef& ref, const std::vector<int64_t>& counts, const TensorInfo& t,
                const std::string& what) {
  if (ref.strides.size() != counts.size()) {
    return InvalidArgumentError(what + ": stride rank differs from box rank for tensor \"" +
                                t.name + "\"");
  }
  for (int64_t s : ref.strides) {
    if (s < 0) return InvalidArgumentError(what + ": negative stride in \"" + t.name + "\"");
  }
  for (int64_t c : counts) {
    if (c < 0) return InvalidArgumentError(what + ": negative box extent");
  }
  const int64_t n = NumElementsOrDie(t.shape);
  if (Elements(counts) > 0 && (ref.offset < 0 || ref.offset + SpanOf(counts, ref.strides) > n)) {
    return InvalidArgumentError(what + ": box outside tensor \"" + t.name + "\" (" +
                                std::to_string(n) + " elements)");
  }
  return Status::Ok();
}

std::string OpWhat(const Op& op) {
  return "parameter \"" + op.param + "\" state \"" + op.state + "\"";
}

// Where a gathered box goes: `bytes` seen as a tensor of `dtype` whose element 0 is at
// destination offset `base` (so a box element at destination offset o is at o - base).
struct Dest {
  std::span<std::byte> bytes;
  DType dtype;
  int64_t base = 0;
};

struct Reader {
  const Plan& plan;
  const TensorSource& source;
  std::atomic<int64_t>& bytes_read;

  Status Read(const TensorInfo& t, int64_t begin, int64_t end, std::span<std::byte> out) const {
    UCP_RETURN_IF_ERROR(source.ReadFlatRange(t, begin, end, out),
                        "while reading \"" + t.name + "\"");
    bytes_read += static_cast<int64_t>(out.size());
    return Status::Ok();
  }

  // Copies the box of source `s` (its srcs[k]) into `dest` at b.dst, casting to dest.dtype.
  Status Gather(const Box& b, size_t k, Dest dest, Scratch& scratch) const {
    const StridedRef& sref = b.srcs[k];
    const TensorInfo& t = plan.sources[sref.tensor];
    const int64_t in_size = DTypeSizeBytes(t.dtype);
    const int64_t out_size = DTypeSizeBytes(dest.dtype);
    const bool same = t.dtype == dest.dtype;
    const int64_t box = Elements(b.counts);
    if (box == 0) return Status::Ok();
    const int64_t row_len = b.counts.empty() ? 1 : b.counts.back();
    const int64_t s_inner = b.counts.empty() ? 1 : sref.strides.back();
    const int64_t d_inner = b.counts.empty() ? 1 : b.dst.strides.back();
    const bool s_rows = s_inner == 1 || row_len == 1;
    const bool d_rows = d_inner == 1 || row_len == 1;
    auto dst_at = [&](int64_t off) { return dest.bytes.data() + (off - dest.base) * out_size; };

    // Puts `n` contiguous source elements (raw, in t.dtype) at a destination row.
    auto put_row = [&](const std::byte* raw, int64_t n, int64_t dst_off) -> Status {
      if (d_rows) {
        std::span<std::byte> out(dst_at(dst_off), static_cast<size_t>(n * out_size));
        if (same) {
          std::memcpy(out.data(), raw, out.size());
          return Status::Ok();
        }
        return CastElements(t.dtype, {raw, static_cast<size_t>(n * in_size)}, dest.dtype, out, n);
      }
      // A strided destination (a transposed copy, as HF's Conv1D weights make): the row is cast
      // in one call, then stored element by element with a fixed-size copy (a per-element cast
      // call was most of an HF import's CPU time).
      const std::byte* from = raw;
      if (!same) {
        UCP_ASSIGN_OR_RETURN(std::span<std::byte> row, Scratch::Get(scratch.row, n * out_size));
        UCP_RETURN_IF_ERROR(
            CastElements(t.dtype, {raw, static_cast<size_t>(n * in_size)}, dest.dtype, row, n));
        from = row.data();
      }
      std::byte* to = dst_at(dst_off);
      switch (out_size) {
        case 2:
          ScatterRow<2>(from, n, to, d_inner);
          break;
        case 4:
          ScatterRow<4>(from, n, to, d_inner);
          break;
        case 8:
          ScatterRow<8>(from, n, to, d_inner);
          break;
        default:
          for (int64_t i = 0; i < n; ++i) {
            std::memcpy(to + i * d_inner * out_size, from + i * out_size,
                        static_cast<size_t>(out_size));
          }
      }
      return Status::Ok();
    };

    const int64_t span = SpanOf(b.counts, sref.strides);
    if (span == box && s_rows) {
      // One flat source range. When the destination is flat too and no cast is needed, read
      // straight into it.
      const int64_t dspan = SpanOf(b.counts, b.dst.strides);
      bool dst_flat = dspan == box && d_rows;
      for (size_t d = 0; dst_flat && d + 1 < b.counts.size(); ++d) {
        dst_flat = b.dst.strides[d] == SpanOf(b.counts, b.dst.strides, d + 1) &&
                   sref.strides[d] == SpanOf(b.counts, sref.strides, d + 1);
      }
      if (dst_flat && same) {
        return Read(t, sref.offset, sref.offset + box,
                    {dst_at(b.dst.offset), static_cast<size_t>(box * out_size)});
      }
      if (dst_flat) {
        UCP_ASSIGN_OR_RETURN(std::span<std::byte> raw, Scratch::Get(scratch.read, box * in_size));
        UCP_RETURN_IF_ERROR(Read(t, sref.offset, sref.offset + box, raw));
        return CastElements(t.dtype, raw, dest.dtype,
                            {dst_at(b.dst.offset), static_cast<size_t>(box * out_size)}, box);
      }
    }
    if (!s_rows) {
      // Strided rows in the source (no plan makes these): element by element.
      UCP_ASSIGN_OR_RETURN(std::span<std::byte> one, Scratch::Get(scratch.read, in_size));
      Status st;
      ForEachRow(b.counts, sref, b.dst, [&](int64_t, int64_t so, int64_t dof) {
        for (int64_t i = 0; i < row_len && st.ok(); ++i) {
          st = Read(t, so + i * s_inner, so + i * s_inner + 1, one);
          if (st.ok()) st = put_row(one.data(), 1, dof + i * d_inner);
        }
      });
      return st;
    }
    const int64_t row_bytes = row_len * in_size;
    const bool dense = span * in_size <= kSpanReadBytes && kSpanDensity * box >= span;
    // Consecutive source rows land in adjacent destination elements, each row strided: a
    // transpose, done in tiles below (after a span too large is cut into blocks).
    const bool transposed = b.counts.size() == 2 && !d_rows && b.dst.strides[0] == 1 &&
                            b.counts[0] > 1 && (out_size == 2 || out_size == 4 || out_size == 8);
    if (b.counts.size() >= 2 && dense && row_bytes < kLongRowBytes && !transposed) {
      // A short-rowed, dense box: its whole source span in one read, rows picked from it.
      UCP_ASSIGN_OR_RETURN(std::span<std::byte> raw, Scratch::Get(scratch.read, span * in_size));
      UCP_RETURN_IF_ERROR(Read(t, sref.offset, sref.offset + span, raw));
      Status st;
      ForEachRow(b.counts, sref, b.dst, [&](int64_t, int64_t so, int64_t dof) {
        if (st.ok()) st = put_row(raw.data() + (so - sref.offset) * in_size, row_len, dof);
      });
      return st;
    }
    if (b.counts.size() >= 2 && span * in_size > kSpanReadBytes && row_bytes < kLongRowBytes &&
        b.counts[0] > 1) {
      // Too large a span for one read: work through it in blocks of the first dimension.
      const int64_t per_row = std::max<int64_t>(1, sref.strides[0]) * in_size;
      const int64_t rows = std::max<int64_t>(1, kSpanReadBytes / per_row);
      if (rows < b.counts[0]) {
        for (int64_t i = 0; i < b.counts[0]; i += rows) {
          UCP_RETURN_IF_ERROR(
              Gather(Rows(b, i, std::min(b.counts[0], i + rows)), k, dest, scratch));
        }
        return Status::Ok();
      }
    }
    if (transposed) {
      // The dense span in one read, else each row by itself; rows packed into a tile, the tile
      // cast in one call, then stored column by column.
      std::span<std::byte> raw;
      if (dense) {
        UCP_ASSIGN_OR_RETURN(raw, Scratch::Get(scratch.read, span * in_size));
        UCP_RETURN_IF_ERROR(Read(t, sref.offset, sref.offset + span, raw));
      }
      const int64_t tile_in = kTileRows * row_bytes;
      const int64_t tile_out = same ? 0 : kTileRows * row_len * out_size;
      UCP_ASSIGN_OR_RETURN(std::span<std::byte> tile, Scratch::Get(scratch.tile, tile_in + tile_out));
      const int64_t s0 = sref.strides[0];
      for (int64_t i0 = 0; i0 < b.counts[0]; i0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, b.counts[0] - i0);
        if (dense) {
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t so = sref.offset + (i0 + i) * s0;
            std::memcpy(tile.data() + i * row_bytes, raw.data() + (so - sref.offset) * in_size,
                        static_cast<size_t>(row_bytes));
          }
        } else {
          // The tile's rows in one call (a source holding the tensor in memory serves them
          // without a lookup per row: the HF import's Conv1D weights).
          const int64_t so = sref.offset + i0 * s0;
          UCP_RETURN_IF_ERROR(source.ReadRows(t, so, s0, rows, row_len,
                                              {tile.data(), static_cast<size_t>(rows * row_bytes)}),
                              "while reading \"" + t.name + "\"");
          bytes_read += rows * row_bytes;
        }
        const std::byte* packed = tile.data();
        if (!same) {
          std::span<std::byte> out(tile.data() + tile_in,
                                   static_cast<size_t>(rows * row_len * out_size));
          UCP_RETURN_IF_ERROR(CastElements(
              t.dtype, {tile.data(), static_cast<size_t>(rows * row_bytes)}, dest.dtype, out,
              rows * row_len));
          packed = out.data();
        }
        std::byte* to = dst_at(b.dst.offset + i0);
        if (out_size == 2) TransposeTile<2>(packed, rows, row_len, to, d_inner);
        if (out_size == 4) TransposeTile<4>(packed, rows, row_len, to, d_inner);
        if (out_size == 8) TransposeTile<8>(packed, rows, row_len, to, d_inner);
      }
      return Status::Ok();
    }
    // Row by row: straight into the destination when it is a plain copy.
    Status st;
    ForEachRow(b.counts, sref, b.dst, [&](int64_t, int64_t so, int64_t dof) {
      if (!st.ok()) return;
      if (same && d_rows) {
        st = Read(t, so, so + row_len, {dst_at(dof), static_cast<size_t>(row_bytes)});
        return;
      }
      Result<std::span<std::byte>> raw = Scratch::Get(scratch.read, row_bytes);
      if (!raw.ok()) {
        st = raw.status();
        return;
      }
      st = Read(t, so, so + row_len, *raw);
      if (st.ok()) st = put_row(raw->data(), row_len, dof);
    });
    return st;
  }
};

// The same box with its destination made packed and zero-based (for checks and averages).
Box Packed(const Box& b) {
  Box p = b;
  p.dst.offset = 0;
  p.dst.strides.assign(b.counts.size(), 1);
  for (size_t d = b.counts.size(); d-- > 1;) {
    p.dst.strides[d - 1] = p.dst.strides[d] * b.counts[d];
  }
  return p;
}

// Splits a box along its first dimension into parts of at most about kBlockElems elements.
template <typename Fn>
Status ForEachBlock(const Box& b, Fn fn) {
  const int64_t n = Elements(b.counts);
  if (n == 0) return Status::Ok();
  if (b.counts.empty() || n <= kBlockElems || b.counts[0] == 1) return fn(b);
  const int64_t per = std::max<int64_t>(1, n / b.counts[0]);
  const int64_t rows = std::max<int64_t>(1, kBlockElems / per);
  for (int64_t i = 0; i < b.counts[0]; i += rows) {
    UCP_RETURN_IF_ERROR(fn(Rows(b, i, std::min(b.counts[0], i + rows))));
  }
  return Status::Ok();
}

Status ApplyPart(const Reader& r, const Op& op, const Box& part, Dest dest, Scratch& scratch) {
  const int64_t out_size = DTypeSizeBytes(dest.dtype);
  switch (op.kind) {
    case OpKind::kFill: {
      const int64_t row_len = part.counts.empty() ? 1 : part.counts.back();
      const int64_t inner = part.counts.empty() ? 1 : part.dst.strides.back();
      StridedRef none;
      none.strides.assign(part.counts.size(), 0);
      ForEachRow(part.counts, none, part.dst, [&](int64_t, int64_t, int64_t dof) {
        std::byte* p = dest.bytes.data() + (dof - dest.base) * out_size;
        if (inner == 1 || row_len == 1) {
          std::memset(p, 0, static_cast<size_t>(row_len * out_size));
        } else {
          for (int64_t i = 0; i < row_len; ++i) std::memset(p + i * inner * out_size, 0, out_size);
        }
      });
      return Status::Ok();
    }
    case OpKind::kCopy:
      if (op.srcs.size() != 1) return InvalidArgumentError(OpWhat(op) + ": copy needs 1 source");
      return r.Gather(part, 0, dest, scratch);
    case OpKind::kAverage: {
      if (!IsFloating(dest.dtype)) {
        return UnimplementedError(OpWhat(op) + ": average of non-floating dtype " +
                                  std::string(DTypeName(dest.dtype)));
      }
      if (op.srcs.empty()) return InvalidArgumentError(OpWhat(op) + ": average needs sources");
      return ForEachBlock(part, [&](const Box& blk) -> Status {
        const int64_t n = Elements(blk.counts);
        const Box packed = Packed(blk);
        UCP_ASSIGN_OR_RETURN(std::span<std::byte> acc, Scratch::Get(scratch.accum, n * 8));
        UCP_ASSIGN_OR_RETURN(std::span<std::byte> one, Scratch::Get(scratch.cast, n * 8));
        double* sum = reinterpret_cast<double*>(acc.data());
        const double* v = reinterpret_cast<const double*>(one.data());
        // Summed from +0.0 in source order, as the reference executor (convert/apply.h) does.
        std::fill(sum, sum + n, 0.0);
        for (size_t k = 0; k < packed.srcs.size(); ++k) {
          UCP_RETURN_IF_ERROR(r.Gather(packed, k, {one, DType::kFp64, 0}, scratch));
          for (int64_t i = 0; i < n; ++i) sum[i] += v[i];
        }
        const double count = static_cast<double>(packed.srcs.size());
        for (int64_t i = 0; i < n; ++i) sum[i] /= count;
        // Scatter the packed means to the destination, cast once.
        StridedRef src_packed = packed.dst;
        std::span<const std::byte> means(acc.data(), static_cast<size_t>(n * 8));
        Status st;
        const int64_t row_len = blk.counts.empty() ? 1 : blk.counts.back();
        const int64_t inner = blk.counts.empty() ? 1 : blk.dst.strides.back();
        ForEachRow(blk.counts, src_packed, blk.dst, [&](int64_t, int64_t so, int64_t dof) {
          for (int64_t i = 0; i < row_len && st.ok(); ++i) {
            std::span<std::byte> out(dest.bytes.data() + (dof + i * inner - dest.base) * out_size,
                                     static_cast<size_t>(out_size));
            st = CastElements(DType::kFp64, means.subspan((so + i) * 8, 8), dest.dtype, out, 1);
          }
        });
        return st;
      });
    }
    case OpKind::kCheckEqual:
      return InternalError("check op given to ApplyPart");
  }
  return InternalError("unknown op kind");
}

Status ValidateOp(const Plan& plan, const Op& op) {
  for (const StridedRef& s : op.srcs) {
    if (s.tensor < 0 || s.tensor >= static_cast<int32_t>(plan.sources.size())) {
      return InvalidArgumentError(OpWhat(op) + ": source index " + std::to_string(s.tensor) +
                                  " outside the plan");
    }
    UCP_RETURN_IF_ERROR(CheckRef(s, op.counts, plan.sources[s.tensor], OpWhat(op)));
  }
  if (op.kind != OpKind::kCheckEqual) {
    UCP_RETURN_IF_ERROR(CheckRef(op.dst, op.counts, plan.targets[op.dst.tensor], OpWhat(op)));
  }
  return Status::Ok();
}

Box BoxOf(const Op& op) { return Box{op.counts, op.dst, op.srcs}; }

// Builds elements [a, e) of `target` into `out` (in the target's dtype).
Status BuildWindow(const Reader& r, const PlanIndex& index, int32_t target, int64_t a, int64_t e,
                   std::span<std::byte> out, Scratch& scratch) {
  const TensorInfo& t = index.plan().targets[target];
  std::vector<Box> parts;
  int64_t covered = 0;
  for (const Op* op : index.OpsOf(target)) {
    parts.clear();
    Clip(BoxOf(*op), a, e, parts);
    for (const Box& part : parts) {
      UCP_RETURN_IF_ERROR(ApplyPart(r, *op, part, {out, t.dtype, a}, scratch));
      covered += Elements(part.counts);
    }
  }
  if (covered != e - a) {
    return InternalError("the plan writes " + std::to_string(covered) + " of elements [" +
                         std::to_string(a) + ", " + std::to_string(e) + ") of target \"" + t.name +
                         "\"");
  }
  return Status::Ok();
}

int64_t WindowElems(const TensorInfo& t, int64_t window_bytes) {
  return std::max<int64_t>(1, window_bytes / DTypeSizeBytes(t.dtype));
}

// The small windows that keep a plain copy in cache (kMaxWindowBytes) hurt two kinds of target,
// which get windows up to 32x larger (at most 32 MiB, what every target had before):
//  * a target cut into many ops (an interleaved fuse: an op per group): each window clips
//    every op of its target (BuildWindow), so the cost is ops x windows;
//  * a target read transposed (a Conv1D weight: source strides not in row-major order): a
//    small window covers a thin band of the source, read as many tiny row pieces (and, when the
//    source is itself a plan, as many nested range builds): an HF -> HF copy of gpt2-medium
//    took 301 s with 1 MiB windows against 5.5 s with 32 MiB ones.
constexpr size_t kManyOps = 64;
constexpr int64_t kWideWindowBytes = int64_t{32} << 20;
bool Transposed(const StridedRef& ref) {
  for (size_t d = 1; d < ref.strides.size(); ++d) {
    if (ref.strides[d] > ref.strides[d - 1]) return true;
  }
  return false;
}
bool ReadsTransposed(const Op& op) {
  if (Transposed(op.dst)) return true;
  for (const StridedRef& src : op.srcs) {
    if (Transposed(src)) return true;
  }
  return false;
}
int64_t TargetWindowBytes(const PlanIndex& index, int32_t target, int64_t window_bytes) {
  const auto& ops = index.OpsOf(target);
  bool wide = ops.size() > kManyOps;
  for (size_t i = 0; i < ops.size() && !wide; ++i) wide = ReadsTransposed(*ops[i]);
  if (!wide) return window_bytes;
  return std::max(window_bytes, std::min(kWideWindowBytes, 32 * window_bytes));
}

Status Stream(const Reader& r, const PlanIndex& index, int32_t target, int64_t window_bytes,
              Scratch& scratch,
              const std::function<Status(int64_t, int64_t, std::span<const std::byte>)>& fn) {
  const Plan& plan = index.plan();
  const TensorInfo& t = plan.targets[target];
  for (const Op* op : index.OpsOf(target)) UCP_RETURN_IF_ERROR(ValidateOp(plan, *op));
  const int64_t n = NumElementsOrDie(t.shape);
  const int64_t size = DTypeSizeBytes(t.dtype);
  const int64_t w = WindowElems(t, TargetWindowBytes(index, target, window_bytes));
  for (int64_t a = 0; a < n; a += w) {
    const int64_t e = std::min(n, a + w);
    UCP_ASSIGN_OR_RETURN(std::span<std::byte> out, Scratch::Get(scratch.window, (e - a) * size));
    UCP_RETURN_IF_ERROR(BuildWindow(r, index, target, a, e, out, scratch));
    UCP_RETURN_IF_ERROR(fn(a, e, out));
  }
  return Status::Ok();
}

Status RunCheck(const Reader& r, const Op& op, Scratch& scratch) {
  if (op.srcs.size() < 2) return Status::Ok();
  UCP_RETURN_IF_ERROR(ValidateOp(r.plan, op));
  const TensorInfo& first = r.plan.sources[op.srcs[0].tensor];
  const int64_t size = DTypeSizeBytes(first.dtype);
  Box whole = BoxOf(op);
  int64_t done = 0;
  return ForEachBlock(whole, [&](const Box& blk) -> Status {
    const int64_t n = Elements(blk.counts);
    const Box packed = Packed(blk);
    UCP_ASSIGN_OR_RETURN(std::span<std::byte> ref, Scratch::Get(scratch.cast, n * size));
    UCP_ASSIGN_OR_RETURN(std::span<std::byte> other, Scratch::Get(scratch.other, n * size));
    UCP_RETURN_IF_ERROR(r.Gather(packed, 0, {ref, first.dtype, 0}, scratch));
    for (size_t i = 1; i < packed.srcs.size(); ++i) {
      const TensorInfo& t = r.plan.sources[packed.srcs[i].tensor];
      UCP_RETURN_IF_ERROR(r.Gather(packed, i, {other, first.dtype, 0}, scratch));
      if (std::memcmp(ref.data(), other.data(), ref.size()) != 0) {
        int64_t el = 0;
        while (std::memcmp(ref.data() + el * size, other.data() + el * size, size) == 0) ++el;
        return DataLossError(OpWhat(op) + ": replicated copies differ at element " +
                             std::to_string(done + el) + " of the box (\"" + first.name +
                             "\" vs \"" + t.name + "\")");
      }
    }
    done += n;
    return Status::Ok();
  });
}

int64_t DefaultWindowBytes(const ExecOptions& o) {
  if (o.window_bytes > 0) return o.window_bytes;
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  if (o.memory_limit_bytes <= 0) return kMaxWindowBytes;
  return std::clamp(o.memory_limit_bytes / (4 * threads), kMinWindowBytes, kMaxWindowBytes);
}

}  // namespace

Status TensorSource::ReadRows(const TensorInfo& tensor, int64_t begin, int64_t stride, int64_t rows,
                              int64_t row_len, std::span<std::byte> out) const {
  const int64_t row_bytes = row_len * DTypeSizeBytes(tensor.dtype);
  if (rows < 0 || row_len < 0 || static_cast<int64_t>(out.size()) != rows * row_bytes) {
    return InvalidArgumentError("reading " + std::to_string(rows) + " rows of " +
                                std::to_string(row_len) + " elements of \"" + tensor.name +
                                "\" into " + std::to_string(out.size()) + " bytes");
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t at = begin + i * stride;
    UCP_RETURN_IF_ERROR(ReadFlatRange(
        tensor, at, at + row_len,
        out.subspan(static_cast<size_t>(i * row_bytes), static_cast<size_t>(row_bytes))));
  }
  return Status::Ok();
}

PlanIndex::PlanIndex(const Plan& plan) : plan_(plan), by_target_(plan.targets.size()) {
  for (const Op& op : plan.ops) {
    if (op.kind == OpKind::kCheckEqual) {
      checks_.push_back(&op);
    } else if (op.dst.tensor >= 0 && op.dst.tensor < static_cast<int32_t>(by_target_.size())) {
      by_target_[op.dst.tensor].push_back(&op);
    }
  }
}

Status StreamTarget(const PlanIndex& index, int32_t target, const TensorSource& source,
                    int64_t window_bytes,
                    const std::function<Status(int64_t, int64_t, std::span<const std::byte>)>& fn) {
  if (target < 0 || target >= static_cast<int32_t>(index.plan().targets.size())) {
    return OutOfRangeError("target " + std::to_string(target) + " outside the plan's " +
                           std::to_string(index.plan().targets.size()));
  }
  std::atomic<int64_t> bytes_read{0};
  Reader r{index.plan(), source, bytes_read};
  Scratch scratch;
  return Stream(r, index, target, window_bytes, scratch, fn);
}

Status BuildTargetRange(const PlanIndex& index, int32_t target, const TensorSource& source,
                        int64_t begin, int64_t end, std::span<std::byte> out) {
  const Plan& plan = index.plan();
  if (target < 0 || target >= static_cast<int32_t>(plan.targets.size())) {
    return OutOfRangeError("target " + std::to_string(target) + " outside the plan's " +
                           std::to_string(plan.targets.size()));
  }
  const TensorInfo& t = plan.targets[target];
  const int64_t n = NumElementsOrDie(t.shape);
  if (begin < 0 || end < begin || end > n) {
    return OutOfRangeError("range [" + std::to_string(begin) + ", " + std::to_string(end) +
                           ") outside target \"" + t.name + "\" of " + std::to_string(n) +
                           " elements");
  }
  if (static_cast<int64_t>(out.size()) != (end - begin) * DTypeSizeBytes(t.dtype)) {
    return InvalidArgumentError("output for target \"" + t.name + "\" has the wrong size");
  }
  for (const Op* op : index.OpsOf(target)) UCP_RETURN_IF_ERROR(ValidateOp(plan, *op));
  std::atomic<int64_t> bytes_read{0};
  Reader r{plan, source, bytes_read};
  Scratch scratch;
  return BuildWindow(r, index, target, begin, end, out, scratch);
}

Result<Tensor> MaterializeTarget(const Plan& plan, int32_t target, const TensorSource& source) {
  if (target < 0 || target >= static_cast<int32_t>(plan.targets.size())) {
    return OutOfRangeError("target " + std::to_string(target) + " outside the plan's " +
                           std::to_string(plan.targets.size()));
  }
  const PlanIndex index(plan);
  const TensorInfo& t = plan.targets[target];
  UCP_ASSIGN_OR_RETURN(Tensor out, Tensor::Uninitialized(t.dtype, t.shape),
                       "for \"" + t.name + "\"");
  std::atomic<int64_t> bytes_read{0};
  Reader r{plan, source, bytes_read};
  Scratch scratch;
  for (const Op* op : index.OpsOf(target)) UCP_RETURN_IF_ERROR(ValidateOp(plan, *op));
  // The whole tensor is one window, built in place.
  const int64_t n = out.num_elements();
  UCP_RETURN_IF_ERROR(BuildWindow(r, index, target, 0, n, out.view().bytes, scratch));
  return out;
}

Result<ExecStats> ExecutePlan(const Plan& plan, const TensorSource& source, TensorSink& sink,
                              const ExecOptions& options) {
  const PlanIndex index(plan);
  std::vector<const Op*> checks = index.checks();
  std::vector<int32_t> selected = options.targets;
  if (selected.empty()) {
    for (int32_t i = 0; i < static_cast<int32_t>(plan.targets.size()); ++i) selected.push_back(i);
  }
  for (int32_t t : selected) {
    if (t < 0 || t >= static_cast<int32_t>(plan.targets.size())) {
      return OutOfRangeError("target " + std::to_string(t) + " outside the plan's " +
                             std::to_string(plan.targets.size()));
    }
  }
  if (!options.targets.empty()) {
    // Only the checks of parameters the selected targets serve.
    std::set<std::string> params;
    for (int32_t t : selected) {
      for (const Op* op : index.OpsOf(t)) params.insert(op->param);
    }
    std::erase_if(checks, [&](const Op* op) { return !params.count(op->param); });
  }
  if (!options.run_checks) checks.clear();
  // Largest targets first, so a big one does not start last and run alone.
  std::stable_sort(selected.begin(), selected.end(), [&](int32_t x, int32_t y) {
    const TensorInfo& a = plan.targets[x];
    const TensorInfo& b = plan.targets[y];
    return NumElementsOrDie(a.shape) * DTypeSizeBytes(a.dtype) >
           NumElementsOrDie(b.shape) * DTypeSizeBytes(b.dtype);
  });
  const int64_t window_bytes = DefaultWindowBytes(options);
  ByteBudget budget(options.memory_limit_bytes);
  std::atomic<int64_t> bytes_read{0}, bytes_written{0}, done{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  Status first_error;
  auto fail = [&](Status s) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (first_error.ok()) first_error = std::move(s);
    failed = true;
  };
  Reader reader{plan, source, bytes_read};
  tbb::enumerable_thread_specific<Scratch> scratch;
  const int64_t total = static_cast<int64_t>(selected.size() + checks.size());
  {
    int64_t total_bytes = 0;
    for (int32_t t : selected) {
      total_bytes +=
          NumElementsOrDie(plan.targets[t].shape) * DTypeSizeBytes(plan.targets[t].dtype);
    }
    if (!options.phase.empty()) progress::BeginPhase(options.phase, total_bytes);
  }
  tbb::parallel_for(
      size_t{0}, selected.size() + checks.size(),
      [&](size_t i) {
        if (failed) return;
        Scratch& s = scratch.local();
        if (i >= selected.size()) {
          const Op& op = *checks[i - selected.size()];
          const int64_t est = 3 * kBlockElems * 8;
          budget.Acquire(est);
          Status st = RunCheck(reader, op, s);
          budget.Release(est);
          if (!st.ok()) return fail(std::move(st));
        } else {
          const int32_t t = selected[i];
          const TensorInfo& info = plan.targets[t];
          const int64_t bytes = NumElementsOrDie(info.shape) * DTypeSizeBytes(info.dtype);
          // The window plus, at worst, as much again in read scratch.
          const int64_t est = 2 * std::min(bytes, TargetWindowBytes(index, t, window_bytes)) + 1;
          budget.Acquire(est);
          Status st = sink.Begin(info);
          if (st.ok()) {
            st = Stream(reader, index, t, window_bytes, s,
                        [&](int64_t a, int64_t e, std::span<const std::byte> data) {
                          bytes_written += static_cast<int64_t>(data.size());
                          progress::AddBytes(static_cast<int64_t>(data.size()));
                          return sink.WriteRange(info, a, e, data);
                        });
          }
          if (st.ok()) st = sink.Finish(info);
          budget.Release(est);
          if (!st.ok()) return fail(std::move(st));
        }
        const int64_t d = ++done;
        if (options.progress) options.progress(d, total);
      },
      tbb::simple_partitioner());
  if (!first_error.ok()) return first_error;
  // A source modified during the run would give an output that verifies but differs from the
  // source checked at the start (issue 16 #8): the last word before the caller commits.
  UCP_RETURN_IF_ERROR(source.CheckUnchanged());
  ExecStats stats;
  stats.targets_written = static_cast<int64_t>(selected.size());
  stats.bytes_read = bytes_read;
  stats.bytes_written = bytes_written;
  stats.peak_in_flight_bytes = budget.peak();
  return stats;
}

struct ScopedThreadLimit::Impl {
  std::unique_ptr<tbb::global_control> control;
};

ScopedThreadLimit::ScopedThreadLimit(int threads) : impl_(std::make_unique<Impl>()) {
  if (threads > 0) {
    impl_->control = std::make_unique<tbb::global_control>(
        tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
  }
}
ScopedThreadLimit::~ScopedThreadLimit() = default;

int64_t PeakRssBytes() {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;
}

Result<int64_t> ParseByteSize(std::string_view text) {
  if (text.empty()) return InvalidArgumentError("empty byte size");
  int64_t mult = 1;
  std::string_view digits = text;
  switch (text.back()) {
    case 'K':
    case 'k':
      mult = int64_t{1} << 10;
      break;
    case 'M':
    case 'm':
      mult = int64_t{1} << 20;
      break;
    case 'G':
    case 'g':
      mult = int64_t{1} << 30;
      break;
    default:
      break;
  }
  if (mult != 1) digits.remove_suffix(1);
  if (digits.empty() || digits.size() > 12) {
    return InvalidArgumentError("byte size \"" + std::string(text) + "\" is not N[K|M|G]");
  }
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') {
      return InvalidArgumentError("byte size \"" + std::string(text) + "\" is not N[K|M|G]");
    }
    v = v * 10 + (c - '0');
  }
  return v * mult;
}

}  // namespace ucp::exec
