// The kernel headers compiled for the host and run over simt_emulation.h's threads (cuda_platform.h).
// The parameter gradients' column sums (cuda_column_kernels.h) against a double sum; the ordered
// sums (cuda_ordered_sum_kernels.h) bitwise against OrderedSum; Ulysses' row moves
// (cuda_move_rows_kernels.h) bitwise against the CPU model's; the flash attention kernels
// (cuda_flash_kernels.h): their tiling, masking, online softmax, the backward's two passes,
// the group sums and every shared-memory index, against the double reference ops (ops::ref) on
// the bf16-rounded inputs, with offload_cuda_ops_test's bounds for the GPU (bf16 probabilities
// and dS: out and dqkv within 2e-2 of max(1, max |ref|), lse within 1e-4). Runs in CI, where no
// GPU is; what it cannot check (WMMA's real layouts, the launch, speed) the GPU test does.
// Shapes: one partial tile; several tiles with the diagonal inside them and a partial last one;
// exact tiles; GQA groups of 1, 2 and 3 heads; each head size the kernels take. Then the same
// bits on a rerun (no atomics), no WMMA rule broken, and shared memory read only where written
// (it starts as NaNs).
#define UCP_SIMT_EMULATION
#include "offload/cuda/cuda_column_kernels.h"
#include "offload/cuda/cuda_flash_kernels.h"
#include "offload/cuda/cuda_move_rows_kernels.h"
#include "offload/cuda/cuda_ordered_sum_kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "offload/comm/ordered_sum.h"
#include "offload/comm/rank_only_communicator.h"
#include "offload/cuda/expect_close.h"
#include "offload/model/ops.h"
#include "offload/model/ulysses.h"
#include "ucp/base/check.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::cuda::flash {
namespace {

std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<double> Rounded(const std::vector<float>& v) {
  std::vector<double> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = FloatFromBf16(Bf16FromFloat(v[i]));
  return r;
}

struct Shape {
  int64_t B, T, NH, KV, hd;
};

std::vector<bf16> ToBf16(const std::vector<float>& v) {
  std::vector<bf16> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = __float2bfloat16_rn(v[i]);
  return r;
}

// As cuda_flash.cu launches them (the bf16 copies of qkv and dout made on the host);
// with_out: the backward reads the forward's output for D.
template <int HD>
void RunFlash(const Shape& s, std::vector<float>& out, std::vector<float>& lse, std::vector<float>& g,
              const std::vector<float>& qkv, const std::vector<float>& dout, bool with_out) {
  const std::vector<bf16> qkv16 = ToBf16(qkv), dout16 = ToBf16(dout);
  std::vector<float> dsum(static_cast<size_t>(s.B * s.NH * s.T), std::nanf(""));
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));
  const unsigned tiles = Tiles(s.T);
  simt::Launch(FlashForwardKernel<HD>, {tiles, static_cast<unsigned>(s.B * s.NH), 1},
               kThreadsPerBlock, Carved<HD, 3, 1>::kBytes, out.data(), lse.data(), qkv16.data(),
               s.T, s.NH, s.KV, scale);
  if (with_out) {
    const int64_t rows = s.B * s.NH * s.T;
    simt::Launch(FlashRowDotKernel, {static_cast<unsigned>((rows * 32 + 255) / 256), 1, 1}, 256, 0,
                 dsum.data(), dout.data(), static_cast<const float*>(out.data()), s.B, s.T, s.NH,
                 int64_t{HD});
  }
  simt::Launch(FlashBackwardQueryKernel<HD>, {tiles, static_cast<unsigned>(s.B * s.NH), 1},
               kThreadsPerBlock, Carved<HD, 4, 1>::kBytes, g.data(), dsum.data(), dout16.data(),
               qkv16.data(), static_cast<const float*>(lse.data()), s.T, s.NH, s.KV, scale,
               with_out);
  simt::Launch(FlashBackwardKeyKernel<HD>, {tiles, static_cast<unsigned>(s.B * s.KV), 1},
               kThreadsPerBlock, Carved<HD, 4, 2>::kBytes, g.data(),
               static_cast<const float*>(dsum.data()), dout16.data(), qkv16.data(),
               static_cast<const float*>(lse.data()), s.T, s.NH, s.KV, scale);
}

class FlashEmulated : public ::testing::TestWithParam<Shape> {};

TEST_P(FlashEmulated, MatchesTheReferenceOnBf16Inputs) {
  const Shape s = GetParam();
  const auto [B, T, NH, KV, hd] = s;
  const int64_t row = (NH + 2 * KV) * hd;
  const auto qkv = Random(B * T * row, 60), d = Random(B * T * NH * hd, 61),
             g0 = Random(B * T * row, 62);
  std::vector<double> rout(B * T * NH * hd), rlse(B * NH * T), rg(g0.begin(), g0.end());
  const std::vector<double> qkv_r = Rounded(qkv), d_r = Rounded(d);
  ops::ref::AttentionForward<double>(rout.data(), rlse.data(), qkv_r.data(), B, T, NH, KV, hd);
  ops::ref::AttentionBackward<double>(rg.data(), d_r.data(), qkv_r.data(), rlse.data(), B, T, NH,
                                      KV, hd);
  auto run = hd == 64 ? RunFlash<64> : hd == 80 ? RunFlash<80> : hd == 96 ? RunFlash<96> : RunFlash<128>;
  // D from a first walk over the keys, then from the forward's output (dout . out).
  for (bool with_out : {false, true}) {
    SCOPED_TRACE(with_out ? "D = dout . out" : "D from the keys");
    std::vector<float> out(rout.size()), lse(rlse.size()), g = g0;
    run(s, out, lse, g, qkv, d, with_out);
    EXPECT_EQ(simt::Violations(), std::vector<std::string>{});
    ExpectClose(out, rout, 2e-2, "forward");
    ExpectClose(lse, rlse, 1e-4, "lse");
    ExpectClose(g, rg, 2e-2, "backward (dqkv added to its start)");
    std::vector<float> out2(out.size()), lse2(lse.size()), g2 = g0;
    run(s, out2, lse2, g2, qkv, d, with_out);
    EXPECT_EQ(0, std::memcmp(out.data(), out2.data(), out.size() * 4));
    EXPECT_EQ(0, std::memcmp(g.data(), g2.data(), g.size() * 4)) << "not deterministic";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FlashEmulated,
    ::testing::Values(Shape{1, 37, 4, 2, 64}, Shape{1, 130, 3, 1, 64}, Shape{1, 64, 2, 2, 64},
                      Shape{1, 70, 2, 1, 128}, Shape{1, 50, 2, 1, 96}, Shape{1, 20, 1, 1, 80}),
    [](const ::testing::TestParamInfo<Shape>& i) {
      const Shape& s = i.param;
      return "B" + std::to_string(s.B) + "T" + std::to_string(s.T) + "NH" + std::to_string(s.NH) +
             "KV" + std::to_string(s.KV) + "hd" + std::to_string(s.hd);
    });

}  // namespace
}  // namespace ucp::offload::cuda::flash

namespace ucp::offload::cuda::kernels {
namespace {

// The parameter gradients' column sums against a double sum: LayerNorm (weight and bias), RMSNorm
// (weight only, no mean) and a bias alone, on row and column counts that are not multiples of
// the 32 x 32 tiling (some columns of the last block idle), added onto a non-zero start; then the
// same bits on a rerun.
TEST(ColumnGradEmulated, MatchesADoubleSum) {
  const int64_t N = 77, C = 45;
  const std::vector<float> dout = flash::Random(N * C, 70), inp = flash::Random(N * C, 71),
                           w0 = flash::Random(C, 72), b0 = flash::Random(C, 73);
  std::vector<float> mean = flash::Random(N, 74), rstd = flash::Random(N, 75);
  for (float& r : rstd) r = 1.0f + std::abs(r);
  for (int mode = 0; mode < 3; ++mode) {  // layernorm, rmsnorm, bias
    SCOPED_TRACE(mode == 0 ? "layernorm" : mode == 1 ? "rmsnorm" : "bias");
    std::vector<double> want_w(w0.begin(), w0.end()), want_b(b0.begin(), b0.end());
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < C; ++c) {
        const double d = dout[n * C + c];
        want_b[c] += d;
        want_w[c] += (inp[n * C + c] - (mode == 0 ? double{mean[n]} : 0.0)) * rstd[n] * d;
      }
    }
    auto run = [&](std::vector<float>& w, std::vector<float>& b) {
      simt::Launch(ColumnGradKernel, {ColumnBlocks(C), 1, 1}, kColumnThreads, kColumnSmemBytes,
                   mode == 2 ? nullptr : w.data(), mode == 1 ? nullptr : b.data(), dout.data(),
                   mode == 2 ? nullptr : inp.data(), mode == 0 ? mean.data() : nullptr,
                   mode == 2 ? nullptr : rstd.data(), N, C);
    };
    std::vector<float> w = w0, b = b0, w2 = w0, b2 = b0;
    run(w, b);
    run(w2, b2);
    EXPECT_EQ(simt::Violations(), std::vector<std::string>{});
    if (mode != 2) {
      ExpectClose(w, want_w, 1e-5, "dweight");
    } else {
      EXPECT_EQ(w, w0) << "dweight untouched";
    }
    if (mode != 1) {
      ExpectClose(b, want_b, 1e-5, "dbias");
    } else {
      EXPECT_EQ(b, b0) << "dbias untouched";
    }
    EXPECT_EQ(0, std::memcmp(w.data(), w2.data(), C * 4));
    EXPECT_EQ(0, std::memcmp(b.data(), b2.data(), C * 4));
  }
}

// The embedding gradient (run-grouped token rows, per-position sums) against the reference op in
// double: repeated tokens (7 distinct over 2 x 37 positions), on a non-zero start, channels not a
// multiple of a block; bitwise the serial walk's fp32 adds (a token's rows onto its row in
// position order); and the token runs themselves.
TEST(EmbeddingGradEmulated, MatchesTheReferenceAndTheSerialWalk) {
  const int64_t B = 2, T = 37, C = 300, V = 11, N = B * T;
  std::vector<int32_t> tokens(static_cast<size_t>(N));
  std::mt19937 rng(80);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 7);
  const std::vector<float> dout = flash::Random(N * C, 81), wte0 = flash::Random(V * C, 82),
                           wpe0 = flash::Random(T * C, 83);
  std::vector<int32_t> order, starts;
  GroupTokenRuns(tokens.data(), N, order, starts);
  ASSERT_EQ(order.size(), static_cast<size_t>(N));
  for (size_t r = 0; r + 1 < starts.size(); ++r) {
    for (int32_t i = starts[r]; i < starts[r + 1]; ++i) {
      EXPECT_EQ(tokens[order[i]], tokens[order[starts[r]]]);  // one token a run
      if (i > starts[r]) {
        EXPECT_LT(order[i - 1], order[i]);  // positions in order
      }
    }
    if (r > 0) {
      EXPECT_LT(tokens[order[starts[r - 1]]], tokens[order[starts[r]]]);
    }
  }
  std::vector<float> wte = wte0, wpe = wpe0;
  const auto runs = static_cast<unsigned>(starts.size() - 1);
  const auto chunks = static_cast<unsigned>((C + 255) / 256);
  simt::Launch(TokenRunGradKernel, {runs, chunks, 1}, 256, 0, wte.data(), dout.data(),
               static_cast<const int32_t*>(tokens.data()), static_cast<const int32_t*>(order.data()),
               static_cast<const int32_t*>(starts.data()), C);
  simt::Launch(PositionGradKernel, {4, 1, 1}, 256, 0, wpe.data(), dout.data(), B, T, C);
  std::vector<double> rwte(wte0.begin(), wte0.end()), rwpe(wpe0.begin(), wpe0.end());
  std::vector<double> d(dout.begin(), dout.end());
  ops::ref::EncoderBackward<double>(rwte.data(), rwpe.data(), d.data(), tokens.data(), B, T, C);
  ExpectClose(wte, rwte, 1e-5, "dwte");
  ExpectClose(wpe, rwpe, 1e-5, "dwpe");
  // The serial walk (the kernel this replaced): each position's row onto its token's, in order.
  std::vector<float> serial = wte0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) serial[tokens[n] * C + c] += dout[n * C + c];
  }
  EXPECT_EQ(0, std::memcmp(serial.data(), wte.data(), wte.size() * 4));
}

// The NCCL communicator's adds (cuda_ordered_sum_kernels.h) are OrderedSum's bits, in both orders,
// for contribution counts with every shape of tree (odd, 2^a, 2^a times odd), on a grid smaller
// than the elements (its stride). The values span many magnitudes, so that another order of the
// adds would change bits: the two orders are checked to differ somewhere for the test's counts.
TEST(OrderedSumEmulated, IsOrderedSumBitwise) {
  const int64_t n = 1000;
  for (int64_t count : {1, 2, 3, 4, 6, 8, 12, 16}) {
    std::vector<float> parts = flash::Random(static_cast<size_t>(count * n), 80 + count);
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i] *= std::ldexp(1.0f, static_cast<int>(i % 29) - 14);
    }
    std::vector<float> sums[2];
    for (int tree = 0; tree < 2; ++tree) {
      SCOPED_TRACE("count " + std::to_string(count) + (tree ? " halving tree" : " rank order"));
      std::vector<float> want(n), got(n, NAN);
      ASSERT_TRUE(OrderedSum(parts, count, want,
                             tree ? SumOrder::kHalvingTree : SumOrder::kRankOrder).ok());
      simt::Launch(OrderedSumKernel, {2, 1, 1}, kOrderedSumThreads, 0, got.data(),
                   static_cast<const float*>(parts.data()), count, n, tree != 0);
      EXPECT_EQ(0, std::memcmp(want.data(), got.data(), n * 4));
      sums[tree] = got;
    }
    if (count == 4 || count == 8 || count == 16) {
      EXPECT_NE(0, std::memcmp(sums[0].data(), sums[1].data(), n * 4)) << "count " << count;
    }
  }
  EXPECT_EQ(simt::Violations(), std::vector<std::string>{});
}

// ---- Ulysses' row moves (cuda_move_rows_kernels.h): the CUDA model's backend of ulysses.h.

// Both backends' all-to-all: a loopback (each of the P blocks back to this rank).
Status Loopback(int64_t P, const float* send, float* recv, int64_t n) {
  std::memcpy(recv, send, static_cast<size_t>(P * n) * 4);
  return Status::Ok();
}

// The CPU model's moves.
struct HostLoopback : graph::HostUlyssesBackend<float> {
  int64_t P = 1;
  Status AllToAll(const float* send, float* recv, int64_t n) { return Loopback(P, send, recv, n); }
};

// The CUDA model's moves: MoveRowsOnDevice's launches of MoveRowsKernel, emulated.
struct EmulatedMoves {
  using Vec = std::vector<float>;
  int64_t P = 1;
  int64_t launches = 0;
  Status Move(std::span<const graph::Strided<float>> moves, int64_t rows, bool add) {
    ForEachMoveLaunch(moves.data(), static_cast<int64_t>(moves.size()), rows, add,
                      [&](const RowMoves& batch, int k, unsigned blocks) {
                        ++launches;
                        simt::Launch(MoveRowsKernel, {blocks, static_cast<unsigned>(k), 1},
                                     kMoveRowsThreads, 0, batch, rows, add);
                      });
    return Status::Ok();
  }
  Status AllToAll(const float* send, float* recv, int64_t n) { return Loopback(P, send, recv, n); }
};

struct UlyssesCase {
  const char* name;
  int64_t heads, kv_heads, P, r;
};

// One rank's four exchanges (forward's qkv to heads and output back; backward's gradient to heads
// and qkv gradient back, added into a gradient already there) through both backends: the same
// bits. The cases split whole KV groups (GPT's one head a group; LLaMA's groups of 2) and
// replicate a KV group on two ranks, whose adds into one value must keep rank order; several
// rows a move, and sequences longer than one.
TEST(UlyssesMovesEmulated, AreTheCpuModelsBitwise) {
  const int64_t B = 2, Tl = 3, hd = 8, N = B * Tl;
  for (const UlyssesCase& u : {UlyssesCase{"gpt heads 4, P 2", 4, 4, 2, 1},
                               UlyssesCase{"gqa heads 8 kv 4, P 2", 8, 4, 2, 0},
                               UlyssesCase{"gqa heads 8 kv 4, P 4", 8, 4, 4, 3},
                               UlyssesCase{"replicated kv 2, P 4", 8, 2, 4, 1}}) {
    SCOPED_TRACE(u.name);
    ModelConfig c;
    c.heads = u.heads;
    c.kv_heads = u.kv_heads;
    c.head_dim = hd;
    // Rank r of P for Ulysses' geometry; nothing is communicated (the backends below hand each
    // all-to-all's blocks back to the same rank, so one process runs every move of one rank).
    RankOnlyCommunicator comm(static_cast<int>(u.r), static_cast<int>(u.P));
    const graph::UlyssesGeometry g(c, u.P, u.r);
    Parallel par(2);
    HostLoopback hb;
    hb.par = &par;
    hb.P = u.P;
    EmulatedMoves eb;
    eb.P = u.P;
    graph::Ulysses<float, HostLoopback> host(&comm, hb, c);
    graph::Ulysses<float, EmulatedMoves> dev(&comm, eb, c);
    host.Allocate(N);
    dev.Allocate(N);
    // Values over many magnitudes, so that adds in another order would change bits.
    auto values = [](size_t n, uint32_t seed) {
      std::vector<float> v = flash::Random(n, seed);
      for (size_t i = 0; i < n; ++i) v[i] *= std::ldexp(1.0f, static_cast<int>(i % 23) - 11);
      return v;
    };
    const int64_t T = u.P * Tl, wh = g.NHl * hd;
    const std::vector<float> qkv = values(static_cast<size_t>(N * g.W), 1);
    const std::vector<float> att = values(static_cast<size_t>(B * T * wh), 2);
    const std::vector<float> datty = values(static_cast<size_t>(N * g.NH * hd), 3);
    const std::vector<float> dqkv_full = values(static_cast<size_t>(B * T * g.Wl), 4);
    const std::vector<float> dqkv0 = values(static_cast<size_t>(N * g.W), 5);
    struct Out {
      std::vector<float> qkv_full, atty, datt_full, dqkv;
    };
    auto run = [&](auto& x) {
      Out o;
      o.qkv_full.assign(static_cast<size_t>(B * T * g.Wl), NAN);
      o.atty.assign(static_cast<size_t>(N * g.NH * hd), NAN);
      o.datt_full.assign(static_cast<size_t>(B * T * wh), NAN);
      o.dqkv = dqkv0;
      UCP_CHECK(x.QkvToHeads(qkv.data(), o.qkv_full.data(), B, Tl).ok());
      UCP_CHECK(x.HeadsToSeq(att.data(), o.atty.data(), B, Tl).ok());
      UCP_CHECK(x.SeqToHeads(datty.data(), o.datt_full.data(), B, Tl).ok());
      UCP_CHECK(x.HeadsToQkv(dqkv_full.data(), o.dqkv.data(), B, Tl).ok());
      return o;
    };
    const Out want = run(host), got = run(dev);
    for (const auto& [w, v, what] :
         {std::tuple{&want.qkv_full, &got.qkv_full, "qkv by heads"},
          std::tuple{&want.atty, &got.atty, "output by positions"},
          std::tuple{&want.datt_full, &got.datt_full, "output gradient by heads"},
          std::tuple{&want.dqkv, &got.dqkv, "qkv gradient"}}) {
      SCOPED_TRACE(what);
      ASSERT_EQ(w->size(), v->size());
      EXPECT_EQ(0, std::memcmp(w->data(), v->data(), w->size() * 4));
      EXPECT_TRUE(std::none_of(v->begin(), v->end(), [](float f) { return std::isnan(f); }))
          << "a value no move wrote";
    }
    // Every KV-gradient add is its own launch (2 P KVl of them), the copies batched.
    EXPECT_GE(dev.backend().launches, 2 * u.P * g.KVl);
  }
  EXPECT_EQ(simt::Violations(), std::vector<std::string>{});
}

}  // namespace
}  // namespace ucp::offload::cuda::kernels
