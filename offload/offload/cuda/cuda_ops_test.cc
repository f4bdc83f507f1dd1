// GPU check (label gpu): every op of cuda_ops.h against the CPU reference twin (ops::ref, run in
// double on the same fp32 inputs), on shapes that are not multiples of the warp or block sizes,
// with GQA groups. Skips where no CUDA device exists; tests/gpu/run_gpu_checks.sh runs it on one.
//
// Tolerance: max |gpu - ref| <= tol x max(1, max |ref|), tol 2e-5 for the element-wise ops,
// norms and fp32 GEMMs (cuBLAS in pedantic math: no TF32), 1e-4 for attention and the
// classifier (exp/log in float over up to T terms), 1e-5 for the bf16 GEMM against the double
// reference of the same bf16 values (exact inputs, fp32 accumulation), and for the mixed GEMMs
// (fp32 activations rounded to bf16 on the device) 2e-5 against the double reference of the
// host-rounded values: the device's rounding must be the host's (nearest even).
#include "offload/cuda/cuda_ops.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <random>
#include <string>
#include <vector>

#include "offload/cuda/cuda_cast.h"
#include "offload/cuda/expect_close.h"
#include "offload/model/ops.h"
#include "offload/train/grad_norm.h"
#include "tests/testutil/status_matchers.h"
#include "ucp/tensor/float_bits.h"

namespace ucp::offload::cuda {
namespace {

using ::testing::HasSubstr;
using ::ucp::testing::StatusIs;

// A device copy of a host vector, freed at scope end.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(const std::vector<T>& h) : n(h.size()) {
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit Dev(size_t count) : Dev(std::vector<T>(count, T(0))) {}
  ~Dev() { cudaFree(p); }
  std::vector<T> Get() const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<double> D(const std::vector<float>& v) { return {v.begin(), v.end()}; }


class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST(CudaOpsArgs, CheckedWithoutADevice) {
  EXPECT_THAT(GeluForward(nullptr, nullptr, -1, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("negative size")));
  EXPECT_THAT(AttentionForward(nullptr, nullptr, nullptr, 1, 1, 6, 4, 8, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("kv_heads must divide heads")));
  EXPECT_THAT(AttentionForward(nullptr, nullptr, nullptr, 1, 1, 4, 2, 512, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("head_dim")));
  // The flash kernels' sizes are checked before anything touches a device.
  EXPECT_FALSE(FlashAttentionSupports(40));
  EXPECT_TRUE(FlashAttentionSupports(64) && FlashAttentionSupports(80) &&
              FlashAttentionSupports(96) && FlashAttentionSupports(128));
  EXPECT_FALSE(FlashAttentionSupports(256));
  EXPECT_THAT(AttentionForwardFlash(nullptr, nullptr, nullptr, 1, 1, 4, 2, 40, nullptr, 0, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("head_dim 40")));
  EXPECT_THAT(AttentionBackwardFlash(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1, 6, 4, 64,
                                     nullptr, 0, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("kv_heads must divide heads")));
  EXPECT_THAT(AttentionForwardFlash(nullptr, nullptr, nullptr, 2, 8, 40000, 40000, 64, nullptr, 0,
                                    nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("batch x heads")));
  const int64_t need = FlashAttentionScratchBytes(2, 8, 4, 2, 64);
  EXPECT_GT(need, 2 * 8 * 8 * 64 * 2);  // the bf16 qkv at least
  EXPECT_THAT(AttentionForwardFlash(nullptr, nullptr, nullptr, 2, 8, 4, 2, 64, nullptr, need - 1,
                                    nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("FlashAttentionScratchBytes")));
  // The embedding gradient's token runs (host): positions grouped by token, in order within one.
  TokenRuns runs;
  const std::vector<int32_t> few{3, 1, 3, 0, 1, 3};
  GroupTokens(few.data(), 6, runs);
  EXPECT_EQ(runs.order, (std::vector<int32_t>{3, 1, 4, 0, 2, 5}));
  EXPECT_EQ(runs.starts, (std::vector<int32_t>{0, 1, 3, 6}));
  EXPECT_EQ(runs.runs(), 3);
  EXPECT_THAT(EncoderBackward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 7, 2, 3, 4,
                              nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("token runs")));
  EXPECT_THAT(GradNormChunks(nullptr, 10, 12, nullptr, nullptr, nullptr),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("multiple of 8")));
}

// The gradient norm's chunk sums on the device are the host's bits (grad_norm.h), every chunk:
// a length that leaves a short last chunk with a tail of 5, magnitudes over many orders (the
// sums' rounding shows any change of order or a fused multiply-add), one chunk holding an inf
// and another a NaN (the max skips the NaN, the sum does not; NaN payloads are not compared).
TEST_F(CudaOps, GradNormChunksAreTheHostsBits) {
  const int64_t n = 3 * kGradNormChunk + 8 * 1000 + 5;
  std::vector<float> g = Random(static_cast<size_t>(n), 41);
  std::mt19937 rng(42);
  for (float& v : g) v *= std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
  g[static_cast<size_t>(kGradNormChunk + 17)] = std::numeric_limits<float>::infinity();
  g[static_cast<size_t>(2 * kGradNormChunk + 3)] = std::nanf("");
  const int64_t chunks = NumGradNormChunks(n);
  ASSERT_EQ(chunks, 4);
  Dev<float> d_g(g);
  Dev<double> d_partial(static_cast<size_t>(chunks));
  Dev<float> d_max(static_cast<size_t>(chunks));
  UCP_ASSERT_OK(GradNormChunks(d_g.p, n, kGradNormChunk, d_partial.p, d_max.p, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> partial = d_partial.Get();
  const std::vector<float> mx = d_max.Get();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kGradNormChunk, e = std::min(n, b + kGradNormChunk);
    double want = 0;
    float want_max = 0;
    SumSquaresAndMax(std::span<const float>(g).subspan(static_cast<size_t>(b),
                                                       static_cast<size_t>(e - b)),
                     &want, &want_max);
    uint64_t got_bits = 0, want_bits = 0;
    std::memcpy(&got_bits, &partial[static_cast<size_t>(c)], 8);
    std::memcpy(&want_bits, &want, 8);
    if (std::isnan(want)) {  // (NaN payloads are the hardware's)
      EXPECT_TRUE(std::isnan(partial[static_cast<size_t>(c)])) << "chunk " << c;
    } else {
      EXPECT_EQ(got_bits, want_bits) << "chunk " << c << ": " << partial[c] << " vs " << want;
    }
    EXPECT_EQ(mx[static_cast<size_t>(c)], want_max) << "chunk " << c;
  }
  EXPECT_TRUE(std::isinf(mx[1]));
  EXPECT_TRUE(std::isnan(partial[2]));
  EXPECT_FALSE(std::isnan(mx[2]));
}

TEST_F(CudaOps, ElementWise) {
  const int64_t N = 37, F = 291, n = N * F;
  const auto x = Random(2 * n, 1, 2.0f), d = Random(2 * n, 2);
  {  // GeLU forward and backward (backward adds into a non-zero dinp)
    Dev<float> dx(x), dout(d), dy(static_cast<size_t>(2 * n)), ddx(Random(2 * n, 3));
    std::vector<double> y(2 * n), g = D(Random(2 * n, 3));
    UCP_ASSERT_OK(GeluForward(dy.p, dx.p, 2 * n, nullptr));
    UCP_ASSERT_OK(GeluBackward(ddx.p, dx.p, dout.p, 2 * n, nullptr));
    ops::ref::GeluForward<double>(y.data(), D(x).data(), 2 * n);
    ops::ref::GeluBackward<double>(g.data(), D(x).data(), D(d).data(), 2 * n);
    ExpectClose(dy.Get(), y, 2e-5, "gelu forward");
    ExpectClose(ddx.Get(), g, 2e-5, "gelu backward");
  }
  {  // SwiGLU over [gate | up]
    Dev<float> dx(x), dout(d), dy(static_cast<size_t>(n)), ddx(static_cast<size_t>(2 * n));
    std::vector<double> y(n), g(2 * n, 0.0);
    UCP_ASSERT_OK(SwigluForward(dy.p, dx.p, N, F, nullptr));
    UCP_ASSERT_OK(SwigluBackward(ddx.p, dx.p, dout.p, N, F, nullptr));
    ops::ref::SwigluForward<double>(y.data(), D(x).data(), N, F);
    ops::ref::SwigluBackward<double>(g.data(), D(x).data(), D(d).data(), N, F);
    ExpectClose(dy.Get(), y, 2e-5, "swiglu forward");
    ExpectClose(ddx.Get(), g, 2e-5, "swiglu backward");
  }
  {  // residual
    const auto b = Random(n, 4);
    Dev<float> da(x), db(b), dout(d), dy(static_cast<size_t>(n)), ga(static_cast<size_t>(n)),
        gb(static_cast<size_t>(n));
    UCP_ASSERT_OK(ResidualForward(dy.p, da.p, db.p, n, nullptr));
    UCP_ASSERT_OK(ResidualBackward(ga.p, gb.p, dout.p, n, nullptr));
    std::vector<double> y(n), ra(n, 0.0), rb(n, 0.0);
    ops::ref::ResidualForward<double>(y.data(), D(x).data(), D(b).data(), n);
    ops::ref::ResidualBackward<double>(ra.data(), rb.data(), D(d).data(), n);
    ExpectClose(dy.Get(), y, 1e-7, "residual forward");
    ExpectClose(ga.Get(), ra, 0.0, "residual backward a");
    ExpectClose(gb.Get(), rb, 0.0, "residual backward b");
  }
}

TEST_F(CudaOps, Norms) {
  const int64_t N = 45, C = 333;
  const auto x = Random(N * C, 5, 3.0f), w = Random(C, 6), b = Random(C, 7), d = Random(N * C, 8);
  Dev<float> dx(x), dw(w), db(b), dd(d);
  {
    Dev<float> y(static_cast<size_t>(N * C)), mean(static_cast<size_t>(N)),
        rstd(static_cast<size_t>(N)), gx(static_cast<size_t>(N * C)), gw(static_cast<size_t>(C)),
        gb(static_cast<size_t>(C));
    UCP_ASSERT_OK(LayerNormForward(y.p, mean.p, rstd.p, dx.p, dw.p, db.p, N, C, 1e-5f, nullptr));
    UCP_ASSERT_OK(LayerNormBackward(gx.p, gw.p, gb.p, dd.p, dx.p, dw.p, mean.p, rstd.p, N, C,
                                    nullptr));
    std::vector<double> ry(N * C), rm(N), rr(N), rgx(N * C, 0.0), rgw(C, 0.0), rgb(C, 0.0);
    ops::ref::LayerNormForward<double>(ry.data(), rm.data(), rr.data(), D(x).data(), D(w).data(),
                                       D(b).data(), N, C, 1e-5);
    ops::ref::LayerNormBackward<double>(rgx.data(), rgw.data(), rgb.data(), D(d).data(),
                                        D(x).data(), D(w).data(), rm.data(), rr.data(), N, C);
    ExpectClose(y.Get(), ry, 2e-5, "layernorm forward");
    ExpectClose(rstd.Get(), rr, 2e-5, "layernorm rstd");
    ExpectClose(gx.Get(), rgx, 2e-5, "layernorm dinp");
    ExpectClose(gw.Get(), rgw, 2e-5, "layernorm dweight");
    ExpectClose(gb.Get(), rgb, 2e-5, "layernorm dbias");
  }
  {
    Dev<float> y(static_cast<size_t>(N * C)), rstd(static_cast<size_t>(N)),
        gx(static_cast<size_t>(N * C)), gw(static_cast<size_t>(C));
    UCP_ASSERT_OK(RmsNormForward(y.p, rstd.p, dx.p, dw.p, N, C, 1e-5f, nullptr));
    UCP_ASSERT_OK(RmsNormBackward(gx.p, gw.p, dd.p, dx.p, dw.p, rstd.p, N, C, nullptr));
    std::vector<double> ry(N * C), rr(N), rgx(N * C, 0.0), rgw(C, 0.0);
    ops::ref::RmsNormForward<double>(ry.data(), rr.data(), D(x).data(), D(w).data(), N, C, 1e-5);
    ops::ref::RmsNormBackward<double>(rgx.data(), rgw.data(), D(d).data(), D(x).data(),
                                      D(w).data(), rr.data(), N, C);
    ExpectClose(y.Get(), ry, 2e-5, "rmsnorm forward");
    ExpectClose(gx.Get(), rgx, 2e-5, "rmsnorm dinp");
    ExpectClose(gw.Get(), rgw, 2e-5, "rmsnorm dweight");
  }
}

TEST_F(CudaOps, MatmulFp32AndBf16) {
  const int64_t N = 67, C = 129, OC = 95;
  const auto x = Random(N * C, 9), w = Random(OC * C, 10, 0.1f), b = Random(OC, 11),
             d = Random(N * OC, 12);
  UCP_ASSERT_OK_AND_ASSIGN(Blas blas, Blas::Create());
  Dev<float> dx(x), dw(w), db(b), dd(d), y(static_cast<size_t>(N * OC)),
      gx(Random(N * C, 13)), gw(static_cast<size_t>(OC * C)), gb(static_cast<size_t>(OC));
  UCP_ASSERT_OK(MatmulForward(blas, y.p, dx.p, dw.p, db.p, N, C, OC));
  UCP_ASSERT_OK(MatmulBackward(blas, gx.p, gw.p, gb.p, dd.p, dx.p, dw.p, N, C, OC));
  std::vector<double> ry(N * OC), rgx = D(Random(N * C, 13)), rgw(OC * C, 0.0), rgb(OC, 0.0);
  ops::ref::MatmulForward<double>(ry.data(), D(x).data(), D(w).data(), D(b).data(), N, C, OC);
  ops::ref::MatmulBackward<double>(rgx.data(), rgw.data(), rgb.data(), D(d).data(), D(x).data(),
                                   D(w).data(), N, C, OC);
  ExpectClose(y.Get(), ry, 2e-5, "matmul forward");
  ExpectClose(gx.Get(), rgx, 2e-5, "matmul dinp");
  ExpectClose(gw.Get(), rgw, 2e-5, "matmul dweight");
  ExpectClose(gb.Get(), rgb, 2e-5, "matmul dbias");

  // bf16 inputs, fp32 accumulation: against the double reference of the same bf16 values.
  std::vector<uint16_t> xb(x.size()), wb(w.size());
  std::vector<float> xr(x.size()), wr(w.size());
  for (size_t i = 0; i < x.size(); ++i) xr[i] = FloatFromBf16(xb[i] = Bf16FromFloat(x[i]));
  for (size_t i = 0; i < w.size(); ++i) wr[i] = FloatFromBf16(wb[i] = Bf16FromFloat(w[i]));
  Dev<uint16_t> dxb(xb), dwb(wb);
  Dev<float> yb(static_cast<size_t>(N * OC));
  UCP_ASSERT_OK(MatmulForwardBf16(blas, yb.p, dxb.p, dwb.p, N, C, OC));
  std::vector<double> ryb(N * OC);
  ops::ref::MatmulForward<double>(ryb.data(), D(xr).data(), D(wr).data(), nullptr, N, C, OC);
  ExpectClose(yb.Get(), ryb, 1e-5, "bf16 matmul forward");
}

// The GEMMs of bf16 training: the device rounds the fp32 activation and gradient to bf16 itself,
// so the reference is the double product of the host-rounded values; the bias and its gradient
// are fp32. Backward adds into non-zero outputs, and the handle's pedantic mode comes back after.
TEST_F(CudaOps, MixedMatmulsRoundTheirInputsToBf16) {
  const int64_t N = 67, C = 129, OC = 95;
  const auto x = Random(N * C, 30), w = Random(OC * C, 31, 0.1f), b = Random(OC, 32),
             d = Random(N * OC, 33), gx0 = Random(N * C, 34), gw0 = Random(OC * C, 35),
             gb0 = Random(OC, 36);
  auto Round = [](const std::vector<float>& v, std::vector<uint16_t>* bits) {
    std::vector<float> r(v.size());
    if (bits) bits->resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = Bf16FromFloat(v[i]);
      r[i] = FloatFromBf16(h);
      if (bits) (*bits)[i] = h;
    }
    return r;
  };
  std::vector<uint16_t> wb;
  const auto wr = Round(w, &wb), xr = Round(x, nullptr), dr = Round(d, nullptr);
  UCP_ASSERT_OK_AND_ASSIGN(Blas blas, Blas::Create());
  Dev<float> dx(x), db(b), dd(d), y(static_cast<size_t>(N * OC)), gx(gx0), gw(gw0), gb(gb0);
  Dev<uint16_t> dwb(wb), scratch(static_cast<size_t>(MixedMatmulScratch(N, C, OC)));
  UCP_ASSERT_OK(MatmulForwardMixed(blas, y.p, dx.p, dwb.p, db.p, N, C, OC, scratch.p));
  UCP_ASSERT_OK(
      MatmulBackwardMixed(blas, gx.p, gw.p, gb.p, dd.p, dx.p, dwb.p, N, C, OC, scratch.p));
  std::vector<double> ry(N * OC), rgx = D(gx0), rgw = D(gw0), rgb = D(gb0), unused(OC * C, 0.0);
  ops::ref::MatmulForward<double>(ry.data(), D(xr).data(), D(wr).data(), D(b).data(), N, C, OC);
  // dinp and dweight from the rounded dout and input; dbias from the fp32 dout.
  ops::ref::MatmulBackward<double>(rgx.data(), rgw.data(), nullptr, D(dr).data(), D(xr).data(),
                                   D(wr).data(), N, C, OC);
  ops::ref::MatmulBackward<double>(nullptr, unused.data(), rgb.data(), D(d).data(), D(xr).data(),
                                   D(wr).data(), N, C, OC);
  ExpectClose(y.Get(), ry, 2e-5, "mixed matmul forward");
  ExpectClose(gx.Get(), rgx, 2e-5, "mixed matmul dinp");
  ExpectClose(gw.Get(), rgw, 2e-5, "mixed matmul dweight");
  ExpectClose(gb.Get(), rgb, 2e-5, "mixed matmul dbias");

  // The fp32 GEMM after them is still pedantic fp32 (no TF32): within 2e-5 of the double one.
  Dev<float> dw(w), y32(static_cast<size_t>(N * OC));
  UCP_ASSERT_OK(MatmulForward(blas, y32.p, dx.p, dw.p, nullptr, N, C, OC));
  std::vector<double> ry32(N * OC);
  ops::ref::MatmulForward<double>(ry32.data(), D(x).data(), D(w).data(), nullptr, N, C, OC);
  ExpectClose(y32.Get(), ry32, 2e-5, "fp32 matmul after the mixed ones");
}

TEST_F(CudaOps, AttentionAndRopeWithGqa) {
  const int64_t B = 2, T = 37, NH = 6, KV = 2, hd = 40, row = (NH + 2 * KV) * hd;
  const auto qkv = Random(B * T * row, 14), d = Random(B * T * NH * hd, 15);
  Dev<float> dq(qkv), dd(d), out(static_cast<size_t>(B * T * NH * hd)),
      lse(static_cast<size_t>(B * NH * T)), g(Random(B * T * row, 16)),
      scratch(static_cast<size_t>(AttentionBackwardScratch(B, T, NH)));
  UCP_ASSERT_OK(AttentionForward(out.p, lse.p, dq.p, B, T, NH, KV, hd, nullptr));
  UCP_ASSERT_OK(AttentionBackward(g.p, dd.p, dq.p, lse.p, scratch.p, B, T, NH, KV, hd, nullptr));
  std::vector<double> rout(B * T * NH * hd), rlse(B * NH * T), rg = D(Random(B * T * row, 16));
  ops::ref::AttentionForward<double>(rout.data(), rlse.data(), D(qkv).data(), B, T, NH, KV, hd);
  ops::ref::AttentionBackward<double>(rg.data(), D(d).data(), D(qkv).data(), rlse.data(), B, T,
                                      NH, KV, hd);
  ExpectClose(out.Get(), rout, 1e-4, "attention forward");
  ExpectClose(lse.Get(), rlse, 1e-4, "attention lse");
  ExpectClose(g.Get(), rg, 1e-4, "attention backward");

  std::vector<float> cos_t(T * hd / 2), sin_t(T * hd / 2);
  ops::RopeTables(cos_t.data(), sin_t.data(), T, hd, 10000.0);
  Dev<float> dc(cos_t), ds(sin_t), rq(qkv);
  UCP_ASSERT_OK(RopeForward(rq.p, dc.p, ds.p, B, T, NH, KV, hd, nullptr));
  std::vector<double> rr = D(qkv);
  ops::ref::RopeForward<double>(rr.data(), D(cos_t).data(), D(sin_t).data(), B, T, NH, KV, hd);
  ExpectClose(rq.Get(), rr, 2e-6, "rope forward");
  UCP_ASSERT_OK(RopeBackward(rq.p, dc.p, ds.p, B, T, NH, KV, hd, nullptr));
  ExpectClose(rq.Get(), D(qkv), 2e-6, "rope backward undoes forward");
}

// The kernels launched with a capped grid loop over their range with the grid's stride: capped
// to one block (SetMaxGridBlocksForTest), every such kernel walks its whole range in that loop
// and gives the bits of the default grid (which covers these shapes in one pass). The fused
// attention's warps had returned past their first query: past 2^23 queries (64 sequences x 32
// heads x 4096 tokens) the last ones were never computed.
TEST_F(CudaOps, KernelsOnAOneBlockGridGiveTheSameBits) {
  const int64_t B = 2, T = 37, NH = 6, KV = 2, hd = 40, row = (NH + 2 * KV) * hd, n = 5000;
  const auto qkv = Random(B * T * row, 24), d = Random(B * T * NH * hd, 25), x = Random(n, 26);
  std::vector<float> cos_t(T * hd / 2), sin_t(T * hd / 2);
  ops::RopeTables(cos_t.data(), sin_t.data(), T, hd, 10000.0);
  struct Outputs {
    std::vector<float> out, lse, g, gelu, rope;
  };
  auto run = [&]() {
    Dev<float> dq(qkv), dd(d), out(static_cast<size_t>(B * T * NH * hd)),
        lse(static_cast<size_t>(B * NH * T)), g(static_cast<size_t>(B * T * row)),
        scratch(static_cast<size_t>(AttentionBackwardScratch(B, T, NH))), dx(x),
        y(static_cast<size_t>(n)), dc(cos_t), ds(sin_t), rq(qkv);
    EXPECT_TRUE(AttentionForward(out.p, lse.p, dq.p, B, T, NH, KV, hd, nullptr).ok());
    EXPECT_TRUE(
        AttentionBackward(g.p, dd.p, dq.p, lse.p, scratch.p, B, T, NH, KV, hd, nullptr).ok());
    EXPECT_TRUE(GeluForward(y.p, dx.p, n, nullptr).ok());
    EXPECT_TRUE(RopeForward(rq.p, dc.p, ds.p, B, T, NH, KV, hd, nullptr).ok());
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return Outputs{out.Get(), lse.Get(), g.Get(), y.Get(), rq.Get()};
  };
  const Outputs wide = run();
  SetMaxGridBlocksForTest(1);
  const Outputs one = run();
  SetMaxGridBlocksForTest(0);
  EXPECT_EQ(one.out, wide.out);
  EXPECT_EQ(one.lse, wide.lse);
  EXPECT_EQ(one.g, wide.g);
  EXPECT_EQ(one.gelu, wide.gelu);
  EXPECT_EQ(one.rope, wide.rope);
  const Outputs again = run();  // the default restored
  EXPECT_EQ(again.g, wide.g);
}

TEST_F(CudaOps, EncoderAndClassifier) {
  const int64_t B = 3, T = 29, C = 70, V = 203, N = B * T;
  std::vector<int32_t> tokens(N), targets(N);
  std::mt19937 rng(17);
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % 7);  // repeated tokens: the gradient adds up
    targets[i] = i % 11 == 0 ? -1 : static_cast<int32_t>(rng() % V);
  }
  const auto wte = Random(V * C, 18), wpe = Random(T * C, 19), d = Random(N * C, 20);
  TokenRuns runs;
  GroupTokens(tokens.data(), N, runs);
  Dev<int32_t> dt(tokens), dtg(targets), dorder(runs.order), dstarts(runs.starts);
  Dev<float> dwte(wte), dwpe(wpe), dd(d), out(static_cast<size_t>(N * C)),
      gwte(static_cast<size_t>(V * C)), gwpe(static_cast<size_t>(T * C));
  UCP_ASSERT_OK(EncoderForward(out.p, dt.p, dwte.p, dwpe.p, B, T, C, nullptr));
  UCP_ASSERT_OK(EncoderBackward(gwte.p, gwpe.p, dd.p, dt.p, dorder.p, dstarts.p, runs.runs(), B, T,
                                C, nullptr));
  std::vector<double> rout(N * C), rgwte(V * C, 0.0), rgwpe(T * C, 0.0);
  ops::ref::EncoderForward<double>(rout.data(), tokens.data(), D(wte).data(), D(wpe).data(), B, T,
                                   C);
  ops::ref::EncoderBackward<double>(rgwte.data(), rgwpe.data(), D(d).data(), tokens.data(), B, T,
                                    C);
  ExpectClose(out.Get(), rout, 1e-7, "encoder forward");
  ExpectClose(gwte.Get(), rgwte, 2e-5, "encoder dwte");
  ExpectClose(gwpe.Get(), rgwpe, 2e-5, "encoder dwpe");

  UCP_ASSERT_OK_AND_ASSIGN(Blas blas, Blas::Create());
  const auto x = Random(N * C, 21);
  Dev<float> dx(x), gx(static_cast<size_t>(N * C)), gw(static_cast<size_t>(V * C)),
      scratch(static_cast<size_t>(ClassifierScratch(N, V)));
  UCP_ASSERT_OK_AND_ASSIGN(double loss, ClassifierForwardBackward(blas, gx.p, gw.p, dx.p, dwte.p,
                                                                  dtg.p, scratch.p, N, C, V,
                                                                  0.01f));
  std::vector<double> rgx(N * C, 0.0), rgw(V * C, 0.0), logits(N * V);
  const double rloss = ops::ref::ClassifierForwardBackward<double>(
      rgx.data(), rgw.data(), logits.data(), D(x).data(), D(wte).data(), targets.data(), N, C, V,
      0.01);
  EXPECT_NEAR(loss, rloss, 1e-4 * std::abs(rloss));
  ExpectClose(gx.Get(), rgx, 1e-4, "classifier dx");
  ExpectClose(gw.Get(), rgw, 1e-4, "classifier dw");

  {  // bf16 GEMMs (the classifier of bf16 training): against the double reference of the
     // bf16-rounded x and w. The loss sees only those roundings (1e-4); dx and dw also the
     // rounding of dlogits to bf16 (about 2^-9 relative: 1e-2).
    std::vector<uint16_t> wb(wte.size());
    std::vector<float> wr(wte.size()), xr(x.size());
    for (size_t i = 0; i < wte.size(); ++i) wr[i] = FloatFromBf16(wb[i] = Bf16FromFloat(wte[i]));
    for (size_t i = 0; i < x.size(); ++i) xr[i] = FloatFromBf16(Bf16FromFloat(x[i]));
    Dev<uint16_t> dwb(wb), s16(static_cast<size_t>(MixedMatmulScratch(N, C, V)));
    Dev<float> mx(static_cast<size_t>(N * C)), mw(static_cast<size_t>(V * C));
    UCP_ASSERT_OK_AND_ASSIGN(double mloss,
                             ClassifierForwardBackward(blas, mx.p, mw.p, dx.p, dwte.p, dtg.p,
                                                       scratch.p, N, C, V, 0.01f, dwb.p, s16.p));
    std::vector<double> mgx(N * C, 0.0), mgw(V * C, 0.0), mlogits(N * V);
    const double mref = ops::ref::ClassifierForwardBackward<double>(
        mgx.data(), mgw.data(), mlogits.data(), D(xr).data(), D(wr).data(), targets.data(), N, C,
        V, 0.01);
    EXPECT_NEAR(mloss, mref, 1e-4 * std::abs(mref));
    ExpectClose(mx.Get(), mgx, 1e-2, "bf16 classifier dx");
    ExpectClose(mw.Get(), mgw, 1e-2, "bf16 classifier dw");
    EXPECT_THAT(ClassifierForwardBackward(blas, nullptr, nullptr, dx.p, dwte.p, dtg.p, scratch.p,
                                          N, C, V, 1.0f, dwb.p, nullptr),
                StatusIs(StatusCode::kInvalidArgument, HasSubstr("scratch")));
    // In blocks of at most 10 rows (as the fp32 case below), bf16 scratch for one block: the
    // same bounds.
    Dev<uint16_t> b16(static_cast<size_t>(MixedMatmulScratch(10, C, V)));
    Dev<float> bscratch(static_cast<size_t>(ClassifierScratch(N, V, 10))),
        bx(static_cast<size_t>(N * C)), bw(static_cast<size_t>(V * C));
    UCP_ASSERT_OK_AND_ASSIGN(double bloss,
                             ClassifierForwardBackward(blas, bx.p, bw.p, dx.p, dwte.p, dtg.p,
                                                       bscratch.p, N, C, V, 0.01f, dwb.p, b16.p,
                                                       10));
    EXPECT_NEAR(bloss, mref, 1e-4 * std::abs(mref));
    ExpectClose(bx.Get(), mgx, 1e-2, "bf16 classifier dx, blocks");
    ExpectClose(bw.Get(), mgw, 1e-2, "bf16 classifier dw, blocks");
  }

  {  // Blocks of rows (what long steps run: the logits of one block at a time): blocks of at
     // most 10 rows (9 blocks, the last of 7), in a scratch that holds one block's logits; the
     // same bounds (bf16: above).
    const int64_t most = 10;
    EXPECT_LT(ClassifierScratch(N, V, most), ClassifierScratch(N, V) / 4);
    Dev<float> bscratch(static_cast<size_t>(ClassifierScratch(N, V, most))),
        bx(static_cast<size_t>(N * C)), bw(static_cast<size_t>(V * C));
    UCP_ASSERT_OK_AND_ASSIGN(double bloss,
                             ClassifierForwardBackward(blas, bx.p, bw.p, dx.p, dwte.p, dtg.p,
                                                       bscratch.p, N, C, V, 0.01f, nullptr,
                                                       nullptr, most));
    EXPECT_NEAR(bloss, rloss, 1e-4 * std::abs(rloss));
    ExpectClose(bx.Get(), rgx, 1e-4, "classifier dx, blocks");
    ExpectClose(bw.Get(), rgw, 1e-4, "classifier dw, blocks");
  }

  targets[3] = static_cast<int32_t>(V);  // out of the vocabulary: refused, not read past
  Dev<int32_t> bad(targets);
  EXPECT_THAT(ClassifierForwardBackward(blas, nullptr, nullptr, dx.p, dwte.p, bad.p, scratch.p, N,
                                        C, V, 1.0f),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("vocabulary")));
  // With the gradient, in blocks: refused at the first block, before any gradient is added.
  Dev<float> zx(std::vector<float>(static_cast<size_t>(N * C), 0.0f)),
      zw(std::vector<float>(static_cast<size_t>(V * C), 0.0f));
  EXPECT_THAT(ClassifierForwardBackward(blas, zx.p, zw.p, dx.p, dwte.p, bad.p, scratch.p, N, C, V,
                                        1.0f, nullptr, nullptr, 10),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("vocabulary")));
  for (const std::vector<float>& g : {zx.Get(), zw.Get()}) {
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; }));
  }
  // A bad target in the last block: refused before the first block adds its gradient.
  targets[3] = 0;
  targets[static_cast<size_t>(N - 1)] = static_cast<int32_t>(V);
  Dev<int32_t> late(targets);
  EXPECT_THAT(ClassifierForwardBackward(blas, zx.p, zw.p, dx.p, dwte.p, late.p, scratch.p, N, C,
                                        V, 1.0f, nullptr, nullptr, 10),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("vocabulary")));
  for (const std::vector<float>& g : {zx.Get(), zw.Get()}) {
    EXPECT_TRUE(std::all_of(g.begin(), g.end(), [](float v) { return v == 0.0f; }));
  }
}

// Attention through GEMMs (bf16 training): against the double reference on the bf16-rounded
// qkv (and dout). The probabilities are rounded to bf16 before the value GEMM, and dS before
// dq and dk, so the bounds are bf16's: out, dqkv within 2e-2, lse (fp32 softmax of exact
// products) within 1e-4. With the default scratch (one pass) and with scratch for one group's
// heads per pass (several passes: the group sums and the pass offsets), the same bounds.
TEST_F(CudaOps, AttentionGemmWithGqaInPasses) {
  const int64_t B = 2, T = 37, NH = 6, KV = 2, hd = 40, row = (NH + 2 * KV) * hd;
  auto Rounded = [](std::vector<float> v) {
    for (float& x : v) x = FloatFromBf16(Bf16FromFloat(x));
    return v;
  };
  const auto qkv = Random(B * T * row, 40), d = Random(B * T * NH * hd, 41),
             g0 = Random(B * T * row, 42);
  const auto qkv_r = Rounded(qkv), d_r = Rounded(d);
  std::vector<double> rout(B * T * NH * hd), rlse(B * NH * T), rg = D(g0);
  ops::ref::AttentionForward<double>(rout.data(), rlse.data(), D(qkv_r).data(), B, T, NH, KV, hd);
  ops::ref::AttentionBackward<double>(rg.data(), D(d_r).data(), D(qkv_r).data(), rlse.data(), B, T,
                                      NH, KV, hd);
  UCP_ASSERT_OK_AND_ASSIGN(Blas blas, Blas::Create());
  for (int64_t pairs : {int64_t{0}, NH / KV}) {
    SCOPED_TRACE("pairs per pass " + std::to_string(pairs));
    const int64_t bytes = AttentionGemmScratchBytes(B, T, NH, KV, hd, pairs);
    ASSERT_GT(bytes, 0);
    Dev<uint8_t> scratch(static_cast<size_t>(bytes));
    Dev<float> dq(qkv), dd(d), out(static_cast<size_t>(B * T * NH * hd)),
        lse(static_cast<size_t>(B * NH * T)), g(g0);
    UCP_ASSERT_OK(AttentionForwardGemm(blas, out.p, lse.p, dq.p, B, T, NH, KV, hd, scratch.p,
                                       bytes));
    UCP_ASSERT_OK(AttentionBackwardGemm(blas, g.p, dd.p, dq.p, lse.p, B, T, NH, KV, hd, scratch.p,
                                        bytes));
    ExpectClose(out.Get(), rout, 2e-2, "gemm attention forward");
    ExpectClose(lse.Get(), rlse, 1e-4, "gemm attention lse");
    ExpectClose(g.Get(), rg, 2e-2, "gemm attention backward");
  }
  // Too little scratch for one group's heads: refused, nothing launched.
  const int64_t small = AttentionGemmScratchBytes(B, T, NH, KV, hd, NH / KV) - T * T * 10;
  Dev<uint8_t> tiny(static_cast<size_t>(small));
  Dev<float> dq(qkv), out(static_cast<size_t>(B * T * NH * hd)), lse(static_cast<size_t>(B * NH * T));
  EXPECT_THAT(AttentionForwardGemm(blas, out.p, lse.p, dq.p, B, T, NH, KV, hd, tiny.p, small),
              StatusIs(StatusCode::kInvalidArgument, HasSubstr("scratch")));
}

// The flash kernels (bf16 training): against the double reference on the bf16-rounded qkv and
// dout, with the GEMM attention's bounds (bf16 probabilities and dS: out and dqkv within 2e-2,
// lse within 1e-4). Shapes: both head sizes; T = 37 (one partial tile), 200 (several tiles, the
// diagonal inside a tile, a partial last one) and 64 (exact tiles); groups of 3 heads and of
// one. dqkv starts non-zero (backward adds). Then the same inputs give the same bits.
TEST_F(CudaOps, FlashAttentionWithGqa) {
  auto Rounded = [](std::vector<float> v) {
    for (float& x : v) x = FloatFromBf16(Bf16FromFloat(x));
    return v;
  };
  struct Shape { int64_t B, T, NH, KV, hd; };
  for (const Shape sh : {Shape{2, 37, 6, 2, 64}, Shape{1, 200, 6, 2, 128}, Shape{2, 64, 2, 2, 128},
                         Shape{1, 200, 3, 3, 64}, Shape{2, 90, 4, 2, 96}, Shape{1, 70, 2, 1, 80}}) {
    const auto [B, T, NH, KV, hd] = sh;
    SCOPED_TRACE("B " + std::to_string(B) + " T " + std::to_string(T) + " NH " +
                 std::to_string(NH) + " KV " + std::to_string(KV) + " hd " + std::to_string(hd));
    const int64_t row = (NH + 2 * KV) * hd;
    const auto qkv = Random(B * T * row, 50), d = Random(B * T * NH * hd, 51),
               g0 = Random(B * T * row, 52);
    const auto qkv_r = Rounded(qkv), d_r = Rounded(d);
    std::vector<double> rout(B * T * NH * hd), rlse(B * NH * T), rg = D(g0);
    ops::ref::AttentionForward<double>(rout.data(), rlse.data(), D(qkv_r).data(), B, T, NH, KV,
                                       hd);
    ops::ref::AttentionBackward<double>(rg.data(), D(d_r).data(), D(qkv_r).data(), rlse.data(), B,
                                        T, NH, KV, hd);
    const int64_t bytes = FlashAttentionScratchBytes(B, T, NH, KV, hd);
    Dev<uint8_t> scratch(static_cast<size_t>(bytes));
    Dev<float> dq(qkv), dd(d), out(static_cast<size_t>(B * T * NH * hd)),
        lse(static_cast<size_t>(B * NH * T));
    UCP_ASSERT_OK(AttentionForwardFlash(out.p, lse.p, dq.p, B, T, NH, KV, hd, scratch.p, bytes,
                                        nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ExpectClose(out.Get(), rout, 2e-2, "flash attention forward");
    ExpectClose(lse.Get(), rlse, 1e-4, "flash attention lse");
    // D from a walk over the keys (no output given), then from the forward's output.
    for (const float* o : {static_cast<const float*>(nullptr), static_cast<const float*>(out.p)}) {
      SCOPED_TRACE(o ? "D = dout . out" : "D from the keys");
      Dev<float> g(g0);
      UCP_ASSERT_OK(AttentionBackwardFlash(g.p, dd.p, dq.p, o, lse.p, B, T, NH, KV, hd, scratch.p,
                                           bytes, nullptr));
      const auto first = g.Get();
      ExpectClose(first, rg, 2e-2, "flash attention backward");
      for (int run = 0; run < 2; ++run) {
        Dev<float> again(g0);
        UCP_ASSERT_OK(AttentionBackwardFlash(again.p, dd.p, dq.p, o, lse.p, B, T, NH, KV, hd,
                                             scratch.p, bytes, nullptr));
        const auto got = again.Get();
        ASSERT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * 4)) << "run " << run;
      }
    }
  }
}

// The same inputs give the same bits (no atomics in any sum).
TEST_F(CudaOps, AttentionBackwardIsDeterministic) {
  const int64_t B = 1, T = 64, NH = 8, KV = 2, hd = 64, row = (NH + 2 * KV) * hd;
  const auto qkv = Random(B * T * row, 22), d = Random(B * T * NH * hd, 23);
  Dev<float> dq(qkv), dd(d), out(static_cast<size_t>(B * T * NH * hd)),
      lse(static_cast<size_t>(B * NH * T)),
      scratch(static_cast<size_t>(AttentionBackwardScratch(B, T, NH)));
  UCP_ASSERT_OK(AttentionForward(out.p, lse.p, dq.p, B, T, NH, KV, hd, nullptr));
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    Dev<float> g(static_cast<size_t>(B * T * row));
    UCP_ASSERT_OK(AttentionBackward(g.p, dd.p, dq.p, lse.p, scratch.p, B, T, NH, KV, hd, nullptr));
    const auto got = g.Get();
    if (run == 0) first = got;
    ASSERT_EQ(0, std::memcmp(first.data(), got.data(), got.size() * 4)) << "run " << run;
  }
}

}  // namespace
}  // namespace ucp::offload::cuda
