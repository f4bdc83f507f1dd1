// Ulysses sequence parallelism (DeepSpeed-Ulysses): the head/sequence exchanges around attention,
// shared by the CPU model (model.cc) and the CUDA model (offload/cuda/cuda_model.cc) the way
// model_graph.h shares the graph. Internal to the engine: not part of the model's API (model.h).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "offload/comm/communicator.h"
#include "offload/model/model.h"
#include "offload/model/ops.h"
#include "offload/model/strided.h"
#include "ucp/base/status.h"
#include "ucp/base/status_macros.h"

namespace ucp::offload::graph {

// ---- Ulysses sequence parallelism (DeepSpeed-Ulysses; the rules are DeepSpeed's)
//
// P ranks, this one r; NH query heads, KV groups of hpg = NH/KV query heads, head_dim hd;
// W = (NH + 2 KV) hd values per fused qkv row (the interleaved groups of the math block); B
// sequences; Tl positions per shard, T = P Tl in all; N = B Tl local rows.
//
// Head assignment. Rank r takes the query heads [r NHl, (r+1) NHl), NHl = NH/P (heads % P == 0),
// and the KV heads they use, as KVl local groups of hpgl = NHl/KVl query heads each:
//   * KV % P == 0 (the usual GQA case, GPT always): KVl = KV/P whole groups, [r KVl, (r+1) KVl),
//     hpgl = hpg. Every KV head lives on one rank.
//   * P % KV == 0, P > KV (replication): KVl = 1; the group g = r / (P/KV) is shared by the P/KV
//     ranks r' with r' / (P/KV) == g, each taking hpgl = NHl of its query heads. Each of them
//     gets a copy of the group's k and v heads, so its k/v gradient is a partial sum: the
//     backward adds the P/KV partials back up, in rank order.
//   Anything else is refused (ValidateSequenceParallel). Local group j of rank r is global group
//   g(r, j) = KV % P == 0 ? r KVl + j : r / (P/KV); its query heads are the global heads
//   [r NHl + j hpgl, + hpgl), found in the fused row at QCol(r, j) (hpgl hd contiguous values);
//   its k then v at KCol(r, j) = g (hpg + 2) hd + hpg hd (2 hd contiguous values).
//   The local fused row has Wl = (NHl + 2 KVl) hd values, the same interleaved-groups layout with
//   NHl heads and KVl groups, so the attention ops run on it unchanged.
//
// The four all-to-alls (AllToAll: in and out are P equal blocks; block j of out <- block r of
// rank j's in). [..] is a row-major shape; "block j" is the leading index.
//   forward, before attention (QkvToHeads):
//     send [P][B][Tl][Wl]: block j = rank j's columns (QCol/KCol of j) of the local qkv [N, W]
//     recv [P][B][Tl][Wl]: block j = positions [j Tl, (j+1) Tl) of this rank's heads
//     -> qkv_full [B][T][Wl] (interleave: row (b, j Tl + t) <- recv[j][b][t])
//   forward, after attention (HeadsToSeq):
//     send [P][B][Tl][NHl hd]: block j = positions [j Tl, (j+1) Tl) of att_full [B][T][NHl hd]
//     recv [P][B][Tl][NHl hd]: block j = rank j's heads [j NHl, (j+1) NHl) at the local positions
//     -> atty [N][NH hd] (columns [j NHl hd, (j+1) NHl hd) <- recv[j]; heads are concatenated
//     head after head, so rank j's heads are one contiguous column block)
//   backward: SeqToHeads is the transpose of HeadsToSeq (datty -> datt_full) and HeadsToQkv that
//     of QkvToHeads (dqkv_full -> dqkv, adding: query columns receive one block each, KV columns
//     one per rank sharing the head, added in rank order).
// Buffers: send and recv of N P Wl floats each (>= N NH hd), owned here; qkv_full lives in the
// per-layer activations (saved for backward: N P Wl per layer, N W without replication), lse is
// [B][NHl][T] (N NH per layer, as without SP). Deterministic: the exchanges are copies and the
// only adds (replicated KV) are in rank order, so for the same P the exchanges give the same bits
// on every backend.
//
// The rearrangements are written once, as lists of strided row moves (Strided), and a backend
// runs them: the CPU model's (HostUlyssesBackend: the Parallel's threads, the communicator's
// AllToAll) and the CUDA model's (offload/cuda/cuda_model.cc: MoveRowsOnDevice launches on its
// stream, the all-to-all over NCCL or staged through the host). So the GPU moves the same values
// to the same places as the CPU model (offload_cuda_emulated_test runs the kernel's launches
// against the CPU backend's moves).
struct UlyssesGeometry {
  int64_t P = 1, r = 0, NH = 0, KV = 0, hd = 0, hpg = 0, W = 0;
  int64_t NHl = 0, KVl = 0, hpgl = 0, Wl = 0;

  UlyssesGeometry(const ModelConfig& c, int64_t size, int64_t rank)
      : P(size), r(rank), NH(c.heads), KV(c.kv_heads), hd(c.head_dim) {
    hpg = NH / KV;
    W = (NH + 2 * KV) * hd;
    NHl = NH / P;
    KVl = KV % P == 0 ? KV / P : 1;
    hpgl = NHl / KVl;
    Wl = (NHl + 2 * KVl) * hd;
  }
  int64_t Group(int64_t rank, int64_t j) const {
    return KV % P == 0 ? rank * KVl + j : rank / (P / KV);
  }
  int64_t QCol(int64_t rank, int64_t j) const {
    const int64_t g = Group(rank, j), first_head = rank * NHl + j * hpgl;
    return g * (hpg + 2) * hd + (first_head - g * hpg) * hd;
  }
  int64_t KCol(int64_t rank, int64_t j) const { return Group(rank, j) * (hpg + 2) * hd + hpg * hd; }
};

/// A Ulysses backend (the CPU's below; the CUDA model's in cuda_model.cc) provides
///   using Vec: a buffer with assign(n, T(0)) (throws std::bad_alloc), data() and size();
///   Status Move(std::span<const Strided<T>> moves, int64_t rows, bool add): every move of
///     `rows` rows; with `add`, the moves add into their destinations, and where several add
///     into one value they do so in list order (the rank order of replicated KV heads);
///   Status AllToAll(const T* send, T* recv, int64_t n): P blocks of n values; block j of recv
///     <- block r of rank j's send (Communicator::AllToAll).
template <typename T, typename Backend>
class Ulysses {
 public:
  using Vec = typename Backend::Vec;
  /// `comm`: the sp group (rank = shard index), for the agreement on each batch (host values).
  Ulysses(Communicator* comm, Backend backend, const ModelConfig& c)
      : comm_(comm), be_(std::move(backend)), geo_(c, comm->size(), comm->rank()) {}

  const UlyssesGeometry& geo() const { return geo_; }
  Backend& backend() { return be_; }
  // Values per local row of the saved qkv_full ([B][T][Wl] holds N P Wl values).
  int64_t qkv_width() const { return geo_.P * geo_.Wl; }

  // Sizes the buffers for up to `max_rows` local rows (throws std::bad_alloc); `output_full`:
  // also out_full(), for ops whose attention backward reads the forward's output.
  void Allocate(int64_t max_rows, bool output_full = false) {
    const int64_t n = max_rows * geo_.P * geo_.Wl;
    send_.assign(static_cast<size_t>(n), T(0));
    recv_.assign(static_cast<size_t>(n), T(0));
    qkv_.assign(static_cast<size_t>(max_rows * geo_.W), T(0));
    att_.assign(static_cast<size_t>(max_rows * geo_.NH * geo_.hd), T(0));
    dqkv_.assign(static_cast<size_t>(n), T(0));
    if (output_full) out_.assign(static_cast<size_t>(max_rows * geo_.NH * geo_.hd), T(0));
  }
  // What Allocate(max_rows, output_full) allocates, in elements (for the memory plans).
  static int64_t Elements(const UlyssesGeometry& g, int64_t max_rows, bool output_full = false) {
    return 3 * max_rows * g.P * g.Wl + max_rows * g.W +
           (output_full ? 2 : 1) * max_rows * g.NH * g.hd;
  }
  int64_t allocated() const {
    return static_cast<int64_t>(send_.size() + recv_.size() + qkv_.size() + att_.size() +
                                dqkv_.size() + out_.size());
  }
  T* qkv_local() { return qkv_.data(); }   // [N, W]: the projection's output, this shard
  T* att_full() { return att_.data(); }    // [B, T, NHl hd]: attention output or its gradient
  T* dqkv_full() { return dqkv_.data(); }  // [B, T, Wl]
  T* out_full() { return out_.data(); }    // [B, T, NHl hd]: the output again (output_full)

  // Every rank agrees on the call before any all-to-all: a batch refused anywhere is refused
  // everywhere, and mismatched shapes or shards never reach a collective of unequal sizes.
  Status Agree(const Status& local, const Batch& b, bool backward) {
    const int64_t base = b.position_offset - geo_.r * b.seq_len, bw = backward ? 1 : 0;
    std::array<int64_t, 9> v = {
        local.ok() ? 0 : 1, b.batch, -b.batch, b.seq_len, -b.seq_len, base, -base, bw, -bw};
    UCP_RETURN_IF_ERROR(comm_->AllReduce(std::span<int64_t>(v), ReduceOp::kMax),
                        "while the sequence-parallel ranks agree on the batch");
    if (!local.ok()) return local;
    const std::string sp = "sequence-parallel group of " + std::to_string(geo_.P) + " ranks";
    if (v[0] != 0) return InvalidArgumentError("another rank of the " + sp + " refused its batch");
    if (v[1] != -v[2] || v[3] != -v[4]) {
      return InvalidArgumentError("the " + sp + " disagree on the shard: batch in [" +
                                  std::to_string(-v[2]) + ", " + std::to_string(v[1]) +
                                  "], seq_len in [" + std::to_string(-v[4]) + ", " +
                                  std::to_string(v[3]) + "]");
    }
    if (v[5] != -v[6]) {
      return InvalidArgumentError("the shards of the " + sp +
                                  " are not consecutive: position_offset - rank * seq_len "
                                  "ranges over [" +
                                  std::to_string(-v[6]) + ", " + std::to_string(v[5]) + "] (rank " +
                                  std::to_string(geo_.r) +
                                  ": position_offset=" + std::to_string(b.position_offset) +
                                  ", seq_len=" + std::to_string(b.seq_len) + ")");
    }
    if (v[7] != -v[8]) {
      return InvalidArgumentError("some ranks of the " + sp +
                                  " call Forward and others ForwardBackward");
    }
    return Status::Ok();
  }

  // qkv [B][Tl][W] (this shard, all heads) -> qkv_full [B][T][Wl] (all positions, this rank's
  // heads).
  Status QkvToHeads(const T* qkv, T* qkv_full, int64_t B, int64_t Tl) {
    const UlyssesGeometry& g = geo_;
    const int64_t N = B * Tl, qn = g.hpgl * g.hd;
    moves_.clear();
    for (int64_t j = 0; j < g.P; ++j) {
      T* dst = send_.data() + j * N * g.Wl;
      for (int64_t k = 0; k < g.KVl; ++k) {
        T* d = dst + k * (g.hpgl + 2) * g.hd;
        moves_.push_back({d, g.Wl, qkv + g.QCol(j, k), g.W, qn});
        moves_.push_back({d + qn, g.Wl, qkv + g.KCol(j, k), g.W, 2 * g.hd});
      }
    }
    UCP_RETURN_IF_ERROR(be_.Move(moves_, N, false), "while ulysses packs qkv");
    UCP_RETURN_IF_ERROR(be_.AllToAll(send_.data(), recv_.data(), N * g.Wl),
                        "while ulysses gathers the sequence of qkv");
    return Interleave(recv_.data(), qkv_full, B, Tl, g.Wl);
  }

  // att_full [B][T][NHl hd] -> atty [B][Tl][NH hd].
  Status HeadsToSeq(const T* att_full, T* atty, int64_t B, int64_t Tl) {
    const int64_t wh = geo_.NHl * geo_.hd;
    UCP_RETURN_IF_ERROR(Deinterleave(att_full, send_.data(), B, Tl, wh));
    UCP_RETURN_IF_ERROR(be_.AllToAll(send_.data(), recv_.data(), B * Tl * wh),
                        "while ulysses returns the attention output");
    return BlocksToColumns(recv_.data(), atty, B * Tl, wh);
  }

  // The transpose of HeadsToSeq: datty [B][Tl][NH hd] -> datt_full [B][T][NHl hd] (also how the
  // forward's output comes back to out_full).
  Status SeqToHeads(const T* datty, T* datt_full, int64_t B, int64_t Tl) {
    const int64_t wh = geo_.NHl * geo_.hd;
    UCP_RETURN_IF_ERROR(ColumnsToBlocks(datty, send_.data(), B * Tl, wh));
    UCP_RETURN_IF_ERROR(be_.AllToAll(send_.data(), recv_.data(), B * Tl * wh),
                        "while ulysses gathers the attention gradient");
    return Interleave(recv_.data(), datt_full, B, Tl, wh);
  }

  // The transpose of QkvToHeads: dqkv [B][Tl][W] += dqkv_full [B][T][Wl] sent back to the
  // shards, replicated KV heads' partial gradients added in rank order.
  Status HeadsToQkv(const T* dqkv_full, T* dqkv, int64_t B, int64_t Tl) {
    const UlyssesGeometry& g = geo_;
    const int64_t N = B * Tl, qn = g.hpgl * g.hd;
    UCP_RETURN_IF_ERROR(Deinterleave(dqkv_full, send_.data(), B, Tl, g.Wl));
    UCP_RETURN_IF_ERROR(be_.AllToAll(send_.data(), recv_.data(), N * g.Wl),
                        "while ulysses returns the qkv gradient");
    moves_.clear();
    for (int64_t j = 0; j < g.P; ++j) {  // rank order: the order of a replicated head's adds
      const T* src = recv_.data() + j * N * g.Wl;
      for (int64_t k = 0; k < g.KVl; ++k) {
        const T* s = src + k * (g.hpgl + 2) * g.hd;
        moves_.push_back({dqkv + g.QCol(j, k), g.W, s, g.Wl, qn});
        moves_.push_back({dqkv + g.KCol(j, k), g.W, s + qn, g.Wl, 2 * g.hd});
      }
    }
    return be_.Move(moves_, N, true);
  }

 private:
  // src [P][B][Tl][w] -> dst [B][P Tl][w]: block j's sequence b to sequence b's positions j Tl.
  Status Interleave(const T* src, T* dst, int64_t B, int64_t Tl, int64_t w) {
    const int64_t P = geo_.P, blk = Tl * w;
    moves_.clear();
    for (int64_t j = 0; j < P; ++j) moves_.push_back({dst + j * blk, P * blk, src + j * B * blk, blk, blk});
    return be_.Move(moves_, B, false);
  }
  // src [B][P Tl][w] -> dst [P][B][Tl][w].
  Status Deinterleave(const T* src, T* dst, int64_t B, int64_t Tl, int64_t w) {
    const int64_t P = geo_.P, blk = Tl * w;
    moves_.clear();
    for (int64_t j = 0; j < P; ++j) moves_.push_back({dst + j * B * blk, blk, src + j * blk, P * blk, blk});
    return be_.Move(moves_, B, false);
  }
  // src [P][N][w] -> dst [N][P w].
  Status BlocksToColumns(const T* src, T* dst, int64_t N, int64_t w) {
    moves_.clear();
    for (int64_t j = 0; j < geo_.P; ++j) moves_.push_back({dst + j * w, geo_.P * w, src + j * N * w, w, w});
    return be_.Move(moves_, N, false);
  }
  // src [N][P w] -> dst [P][N][w].
  Status ColumnsToBlocks(const T* src, T* dst, int64_t N, int64_t w) {
    moves_.clear();
    for (int64_t j = 0; j < geo_.P; ++j) moves_.push_back({dst + j * N * w, w, src + j * w, geo_.P * w, w});
    return be_.Move(moves_, N, false);
  }

  Communicator* comm_;
  Backend be_;
  UlyssesGeometry geo_;
  Vec send_, recv_, qkv_, att_, dqkv_, out_;
  std::vector<Strided<T>> moves_;
};

/// The CPU model's backend: the moves on the Parallel's threads (copies split over rows x moves;
/// adds over rows only, so a row's adds into one value keep the list's order), the all-to-all on
/// the calling thread over the sp communicator (fp32 only: the double reference never shards).
template <typename T>
struct HostUlyssesBackend {
  using Vec = std::vector<T>;
  Parallel* par = nullptr;
  Communicator* comm = nullptr;

  Status Move(std::span<const Strided<T>> moves, int64_t rows, bool add) {
    const int64_t E = static_cast<int64_t>(moves.size());
    if (add) {
      par->For(rows, [&](int, int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          for (const Strided<T>& m : moves) {
            T* d = m.dst + r * m.dpitch;
            const T* s = m.src + r * m.spitch;
            for (int64_t i = 0; i < m.width; ++i) d[i] += s[i];
          }
        }
      });
    } else {
      par->For(rows * E, [&](int, int64_t u0, int64_t u1) {
        for (int64_t u = u0; u < u1; ++u) {
          const Strided<T>& m = moves[static_cast<size_t>(u % E)];
          const int64_t r = u / E;
          std::memcpy(m.dst + r * m.dpitch, m.src + r * m.spitch, sizeof(T) * m.width);
        }
      });
    }
    return Status::Ok();
  }
  Status AllToAll(const T* send, T* recv, int64_t n) {
    const size_t count = static_cast<size_t>(comm->size() * n);
    if constexpr (std::is_same_v<T, float>) {
      return comm->AllToAll(std::span<const float>(send, count), std::span<float>(recv, count));
    } else {
      (void)count, (void)send, (void)recv;
      return UnimplementedError("sequence parallelism runs in fp32 only");
    }
  }
};

}  // namespace ucp::offload::graph
