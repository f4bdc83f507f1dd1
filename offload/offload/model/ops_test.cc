// Every op twice: the reference's backward against central finite differences of its forward in
// fp64, and the fast path against the reference in fp32, over shapes that are not multiples of
// the vector width, with grouped-query heads and head_dim != hidden / heads.
#include "offload/model/ops.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace ucp::offload {
namespace {

using Vec = std::vector<double>;
using VecF = std::vector<float>;

template <typename T>
std::vector<T> Random(size_t n, uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(dist(rng));
  return v;
}

double Dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Compares analytic gradients grads[k] of loss() w.r.t. *vars[k] with central differences at up
// to `max_checks` evenly spread elements of each var.
void ExpectFd(const std::vector<Vec*>& vars, const std::vector<Vec>& grads,
              const std::function<double()>& loss, double tol = 1e-6, size_t max_checks = 48) {
  constexpr double kH = 1e-5;
  for (size_t k = 0; k < vars.size(); ++k) {
    Vec& v = *vars[k];
    ASSERT_EQ(v.size(), grads[k].size());
    const size_t step = std::max<size_t>(1, v.size() / max_checks);
    for (size_t i = 0; i < v.size(); i += step) {
      const double saved = v[i];
      v[i] = saved + kH;
      const double up = loss();
      v[i] = saved - kH;
      const double down = loss();
      v[i] = saved;
      const double fd = (up - down) / (2 * kH);
      ASSERT_NEAR(grads[k][i], fd, tol * (1 + std::abs(fd))) << "var " << k << " element " << i;
    }
  }
}

// max |a - b| <= tol * max(1, max |b|)
void ExpectClose(const VecF& a, const VecF& b, double tol, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double scale = 1, worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) scale = std::max(scale, std::abs(double(b[i])));
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(double(a[i]) - double(b[i]));
    if (d > worst) worst = d, at = i;
  }
  EXPECT_LE(worst, tol * scale) << what << ": at " << at << " fast " << a[at] << " ref " << b[at];
}

// ------------------------------------------------------------------------------------------
// Finite differences of the fp64 reference.

TEST(OpsRefFd, LayerNormAndRmsNorm) {
  for (int64_t C : {1, 3, 17, 64, 65}) {
    SCOPED_TRACE("C=" + std::to_string(C));
    const int64_t N = 3;
    Vec x = Random<double>(N * C, 1), w = Random<double>(C, 2), b = Random<double>(C, 3);
    const Vec r = Random<double>(N * C, 4);
    Vec out(N * C), mean(N), rstd(N);
    auto ln = [&] {
      ops::ref::LayerNormForward<double>(out.data(), mean.data(), rstd.data(), x.data(), w.data(),
                                         b.data(), N, C, 1e-5);
      return Dot(out, r);
    };
    ln();
    Vec dx(N * C, 0.5), dw(C, 0.25), db(C, -1);  // nonzero: backward must add
    ops::ref::LayerNormBackward<double>(dx.data(), dw.data(), db.data(), r.data(), x.data(),
                                        w.data(), mean.data(), rstd.data(), N, C);
    for (auto& v : dx) v -= 0.5;
    for (auto& v : dw) v -= 0.25;
    for (auto& v : db) v += 1;
    // C == 1 normalises to zero: the input gradient is exactly 0 and FD sees only eps noise.
    ExpectFd({&x, &w, &b}, {dx, dw, db}, ln, C == 1 ? 1e-4 : 1e-6);

    auto rms = [&] {
      ops::ref::RmsNormForward<double>(out.data(), rstd.data(), x.data(), w.data(), N, C, 1e-5);
      return Dot(out, r);
    };
    rms();
    Vec dx2(N * C, 0), dw2(C, 0);
    ops::ref::RmsNormBackward<double>(dx2.data(), dw2.data(), r.data(), x.data(), w.data(),
                                      rstd.data(), N, C);
    ExpectFd({&x, &w}, {dx2, dw2}, rms);
  }
}

TEST(OpsRefFd, MatmulWithAndWithoutBias) {
  for (auto [N, C, OC] : {std::tuple{1, 1, 1}, {3, 17, 5}, {5, 65, 3}}) {
    Vec x = Random<double>(N * C, 5), w = Random<double>(OC * C, 6), b = Random<double>(OC, 7);
    const Vec r = Random<double>(N * OC, 8);
    Vec out(N * OC);
    for (bool bias : {true, false}) {
      auto f = [&] {
        ops::ref::MatmulForward<double>(out.data(), x.data(), w.data(), bias ? b.data() : nullptr,
                                        N, C, OC);
        return Dot(out, r);
      };
      Vec dx(N * C, 0), dw(OC * C, 0), db(OC, 0);
      ops::ref::MatmulBackward<double>(dx.data(), dw.data(), bias ? db.data() : nullptr, r.data(),
                                       x.data(), w.data(), N, C, OC);
      if (bias) {
        ExpectFd({&x, &w, &b}, {dx, dw, db}, f);
      } else {
        ExpectFd({&x, &w}, {dx, dw}, f);
      }
    }
  }
}

struct AttnShape {
  int64_t B, T, NH, KV, hd;
};
const AttnShape kAttnShapes[] = {
    {1, 1, 1, 1, 3}, {2, 5, 8, 2, 4}, {1, 33, 8, 4, 6}, {2, 5, 8, 8, 5}, {1, 17, 3, 1, 16}};

TEST(OpsRefFd, AttentionGqa) {
  for (const AttnShape& s : kAttnShapes) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH) +
                 " KV=" + std::to_string(s.KV) + " hd=" + std::to_string(s.hd));
    const int64_t row = (s.NH + 2 * s.KV) * s.hd, N = s.B * s.T;
    Vec qkv = Random<double>(N * row, 9);
    const Vec r = Random<double>(N * s.NH * s.hd, 10);
    Vec out(N * s.NH * s.hd), lse(s.B * s.NH * s.T);
    auto f = [&] {
      ops::ref::AttentionForward<double>(out.data(), lse.data(), qkv.data(), s.B, s.T, s.NH, s.KV,
                                         s.hd);
      return Dot(out, r);
    };
    f();
    Vec dqkv(N * row, 0);
    ops::ref::AttentionBackward<double>(dqkv.data(), r.data(), qkv.data(), lse.data(), s.B, s.T,
                                        s.NH, s.KV, s.hd);
    ExpectFd({&qkv}, {dqkv}, f, 1e-6, 200);
  }
}

TEST(OpsRefFd, RopeIsARotationAndItsBackwardTheTranspose) {
  for (const AttnShape& s : {AttnShape{2, 5, 8, 2, 4}, AttnShape{1, 33, 4, 4, 6}}) {
    const int64_t row = (s.NH + 2 * s.KV) * s.hd, N = s.B * s.T, half = s.hd / 2;
    Vec cos_t(s.T * half), sin_t(s.T * half);
    ops::ref::RopeTables<double>(cos_t.data(), sin_t.data(), s.T, s.hd, 10000.0);
    Vec qkv = Random<double>(N * row, 11);
    const Vec r = Random<double>(N * row, 12);
    Vec y;
    auto f = [&] {
      y = qkv;
      ops::ref::RopeForward<double>(y.data(), cos_t.data(), sin_t.data(), s.B, s.T, s.NH, s.KV,
                                    s.hd);
      return Dot(y, r);
    };
    f();
    Vec g = r;
    ops::ref::RopeBackward<double>(g.data(), cos_t.data(), sin_t.data(), s.B, s.T, s.NH, s.KV,
                                   s.hd);
    ExpectFd({&qkv}, {g}, f, 1e-6, 300);
    // v rows are untouched; position 0 is the identity.
    for (int64_t i = 0; i < s.hd; ++i) {
      const int64_t v = s.NH / s.KV * s.hd + s.hd + i;  // group 0's v, row 0
      EXPECT_EQ(y[v], qkv[v]);
      EXPECT_EQ(y[i], qkv[i]);
    }
  }
}

TEST(OpsRefFd, GeluSwigluResidual) {
  for (int64_t n : {1, 3, 17, 65}) {
    Vec x = Random<double>(2 * n, 13, 2.0);
    const Vec r = Random<double>(2 * n, 14);
    Vec out(2 * n);
    auto gelu = [&] {
      ops::ref::GeluForward<double>(out.data(), x.data(), 2 * n);
      return Dot(out, r);
    };
    Vec dx(2 * n, 0);
    ops::ref::GeluBackward<double>(dx.data(), x.data(), r.data(), 2 * n);
    ExpectFd({&x}, {dx}, gelu);

    const Vec rs(r.begin(), r.begin() + n);
    Vec o2(n);
    auto swiglu = [&] {
      ops::ref::SwigluForward<double>(o2.data(), x.data(), 1, n);
      return Dot(o2, rs);
    };
    Vec dx2(2 * n, 0);
    ops::ref::SwigluBackward<double>(dx2.data(), x.data(), rs.data(), 1, n);
    ExpectFd({&x}, {dx2}, swiglu);

    Vec a = Random<double>(n, 15), b = Random<double>(n, 16);
    auto res = [&] {
      ops::ref::ResidualForward<double>(o2.data(), a.data(), b.data(), n);
      return Dot(o2, rs);
    };
    Vec da(n, 0), db(n, 0);
    ops::ref::ResidualBackward<double>(da.data(), db.data(), rs.data(), n);
    ExpectFd({&a, &b}, {da, db}, res);
  }
  // gelu_tanh at a few points (GPT-2's gelu_new).
  const double x[] = {-3, -0.5, 0, 1, 2.5};
  double y[5];
  ops::ref::GeluForward<double>(y, x, 5);
  for (int i = 0; i < 5; ++i) {
    const double e =
        0.5 * x[i] * (1 + std::tanh(std::sqrt(2 / M_PI) * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
    EXPECT_DOUBLE_EQ(y[i], e);
  }
}

TEST(OpsRefFd, EncoderWithAndWithoutPositions) {
  const int64_t B = 2, T = 5, C = 3, V = 7;
  const std::vector<int32_t> tok = {1, 6, 1, 0, 3, 3, 3, 2, 6, 1};
  Vec wte = Random<double>(V * C, 17), wpe = Random<double>(T * C, 18);
  const Vec r = Random<double>(B * T * C, 19);
  Vec out(B * T * C);
  for (bool pos : {true, false}) {
    auto f = [&] {
      ops::ref::EncoderForward<double>(out.data(), tok.data(), wte.data(),
                                       pos ? wpe.data() : nullptr, B, T, C);
      return Dot(out, r);
    };
    Vec dwte(V * C, 0), dwpe(T * C, 0);
    ops::ref::EncoderBackward<double>(dwte.data(), pos ? dwpe.data() : nullptr, r.data(),
                                      tok.data(), B, T, C);
    ExpectFd({&wte, &wpe}, {dwte, dwpe}, f);
  }
}

TEST(OpsRefFd, ClassifierIgnoresPaddingAndMaskedTargets) {
  const int64_t N = 6, C = 5, V = 11, Vp = 16;
  Vec x = Random<double>(N * C, 20), w = Random<double>(Vp * C, 21);
  const std::vector<int32_t> tg = {3, -1, 10, 0, 3, -100};
  Vec logits(N * V);
  auto f = [&] {
    return ops::ref::ClassifierForwardBackward<double>(nullptr, nullptr, logits.data(), x.data(),
                                                       w.data(), tg.data(), N, C, V, 1.0);
  };
  // Against the textbook formula.
  double expected = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (tg[n] < 0) continue;
    double z = 0, lt = 0;
    for (int64_t v = 0; v < V; ++v) {
      double l = 0;
      for (int64_t c = 0; c < C; ++c) l += x[n * C + c] * w[v * C + c];
      z += std::exp(l);
      if (v == tg[n]) lt = l;
    }
    expected += std::log(z) - lt;
  }
  EXPECT_NEAR(f(), expected, 1e-12);
  Vec dx(N * C, 0), dw(Vp * C, 0);
  const double loss = ops::ref::ClassifierForwardBackward<double>(
      dx.data(), dw.data(), logits.data(), x.data(), w.data(), tg.data(), N, C, V, 1.0);
  EXPECT_NEAR(loss, expected, 1e-12);
  ExpectFd({&x, &w}, {dx, dw}, f, 1e-6, 100);
  for (int64_t i = V * C; i < Vp * C; ++i) EXPECT_EQ(dw[i], 0.0);
}

// ------------------------------------------------------------------------------------------
// Fast path against the fp32 reference.

class OpsFast : public testing::TestWithParam<int> {
 protected:
  Parallel par_{GetParam()};
};

TEST_P(OpsFast, NormsMatchReference) {
  for (int64_t C : {1, 3, 17, 64, 65, 768}) {
    for (int64_t N : {1, 5, 37}) {
      SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
      const VecF x = Random<float>(N * C, 30), w = Random<float>(C, 31), b = Random<float>(C, 32);
      const VecF d = Random<float>(N * C, 33);
      VecF o1(N * C), m1(N), s1(N), o2(N * C), m2(N), s2(N);
      ops::LayerNormForward(par_, o1.data(), m1.data(), s1.data(), x.data(), w.data(), b.data(), N,
                            C, 1e-5f);
      ops::ref::LayerNormForward<float>(o2.data(), m2.data(), s2.data(), x.data(), w.data(),
                                        b.data(), N, C, 1e-5f);
      ExpectClose(o1, o2, 2e-5, "ln out");
      ExpectClose(s1, s2, 2e-5, "ln rstd");
      VecF dx1(N * C, 1), dw1(C, 1), db1(C, 1), dx2(N * C, 1), dw2(C, 1), db2(C, 1);
      ops::LayerNormBackward(par_, dx1.data(), dw1.data(), db1.data(), d.data(), x.data(), w.data(),
                             m2.data(), s2.data(), N, C);
      ops::ref::LayerNormBackward<float>(dx2.data(), dw2.data(), db2.data(), d.data(), x.data(),
                                         w.data(), m2.data(), s2.data(), N, C);
      ExpectClose(dx1, dx2, 2e-5, "ln dx");
      ExpectClose(dw1, dw2, 2e-5, "ln dw");
      ExpectClose(db1, db2, 2e-5, "ln db");

      ops::RmsNormForward(par_, o1.data(), s1.data(), x.data(), w.data(), N, C, 1e-5f);
      ops::ref::RmsNormForward<float>(o2.data(), s2.data(), x.data(), w.data(), N, C, 1e-5f);
      ExpectClose(o1, o2, 2e-5, "rms out");
      ops::RmsNormBackward(par_, dx1.data(), dw1.data(), d.data(), x.data(), w.data(), s2.data(), N,
                           C);
      ops::ref::RmsNormBackward<float>(dx2.data(), dw2.data(), d.data(), x.data(), w.data(),
                                       s2.data(), N, C);
      ExpectClose(dx1, dx2, 2e-5, "rms dx");
      ExpectClose(dw1, dw2, 2e-5, "rms dw");
    }
  }
}

TEST_P(OpsFast, MatmulMatchesReference) {
  for (auto [N, C, OC] : {std::tuple{1, 1, 1}, {5, 17, 3}, {37, 65, 130}, {64, 768, 96}}) {
    const VecF x = Random<float>(N * C, 34), w = Random<float>(OC * C, 35);
    const VecF b = Random<float>(OC, 36), d = Random<float>(N * OC, 37);
    VecF o1(N * OC), o2(N * OC);
    ops::MatmulForward(par_, o1.data(), x.data(), w.data(), b.data(), N, C, OC);
    ops::ref::MatmulForward<float>(o2.data(), x.data(), w.data(), b.data(), N, C, OC);
    ExpectClose(o1, o2, 1e-5 * std::sqrt(C), "mm out");
    VecF dx1(N * C, 1), dw1(OC * C, 1), db1(OC, 1), dx2 = dx1, dw2 = dw1, db2 = db1;
    ops::MatmulBackward(par_, dx1.data(), dw1.data(), db1.data(), d.data(), x.data(), w.data(), N,
                        C, OC);
    ops::ref::MatmulBackward<float>(dx2.data(), dw2.data(), db2.data(), d.data(), x.data(),
                                    w.data(), N, C, OC);
    ExpectClose(dx1, dx2, 1e-5 * std::sqrt(OC), "mm dx");
    ExpectClose(dw1, dw2, 1e-5 * std::sqrt(N), "mm dw");
    ExpectClose(db1, db2, 1e-5 * std::sqrt(N), "mm db");
  }
}

TEST_P(OpsFast, AttentionAndRopeMatchReference) {
  std::vector<AttnShape> shapes(std::begin(kAttnShapes), std::end(kAttnShapes));
  shapes.push_back({2, 64, 4, 4, 64});
  shapes.push_back({1, 33, 8, 2, 64});
  for (const AttnShape& s : shapes) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " NH=" + std::to_string(s.NH) +
                 " KV=" + std::to_string(s.KV) + " hd=" + std::to_string(s.hd));
    const int64_t row = (s.NH + 2 * s.KV) * s.hd, N = s.B * s.T, ah = s.NH * s.hd;
    const VecF qkv = Random<float>(N * row, 40), d = Random<float>(N * ah, 41);
    VecF o1(N * ah), l1(s.B * s.NH * s.T), o2 = o1, l2 = l1;
    ops::AttentionForward(par_, o1.data(), l1.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.hd);
    ops::ref::AttentionForward<float>(o2.data(), l2.data(), qkv.data(), s.B, s.T, s.NH, s.KV, s.hd);
    ExpectClose(o1, o2, 1e-5, "attn out");
    ExpectClose(l1, l2, 1e-5, "attn lse");
    VecF g1(N * row, 0.5f), g2 = g1;
    ops::AttentionBackward(par_, g1.data(), d.data(), qkv.data(), l2.data(), s.B, s.T, s.NH, s.KV,
                           s.hd);
    ops::ref::AttentionBackward<float>(g2.data(), d.data(), qkv.data(), l2.data(), s.B, s.T, s.NH,
                                       s.KV, s.hd);
    ExpectClose(g1, g2, 2e-5, "attn dqkv");

    if (s.hd % 2 != 0) continue;
    const int64_t half = s.hd / 2;
    VecF c1(s.T * half), s1(s.T * half);
    ops::RopeTables(c1.data(), s1.data(), s.T, s.hd, 10000.0);
    VecF r1 = qkv, r2 = qkv;
    ops::RopeForward(par_, r1.data(), c1.data(), s1.data(), s.B, s.T, s.NH, s.KV, s.hd);
    ops::ref::RopeForward<float>(r2.data(), c1.data(), s1.data(), s.B, s.T, s.NH, s.KV, s.hd);
    EXPECT_EQ(r1, r2);
    ops::RopeBackward(par_, r1.data(), c1.data(), s1.data(), s.B, s.T, s.NH, s.KV, s.hd);
    ops::ref::RopeBackward<float>(r2.data(), c1.data(), s1.data(), s.B, s.T, s.NH, s.KV, s.hd);
    EXPECT_EQ(r1, r2);
  }
}

TEST_P(OpsFast, ElementwiseMatchReference) {
  for (int64_t n : {1, 3, 17, 65, 1000}) {
    VecF x = Random<float>(2 * n, 50, 3.0);
    x[0] = 40.0f;  // saturating tanh / exp
    if (n > 1) x[1] = -40.0f;
    const VecF d = Random<float>(2 * n, 51);
    VecF o1(2 * n), o2(2 * n), g1(2 * n, 1), g2(2 * n, 1);
    ops::GeluForward(par_, o1.data(), x.data(), 2 * n);
    ops::ref::GeluForward<float>(o2.data(), x.data(), 2 * n);
    ExpectClose(o1, o2, 1e-6, "gelu");
    ops::GeluBackward(par_, g1.data(), x.data(), d.data(), 2 * n);
    ops::ref::GeluBackward<float>(g2.data(), x.data(), d.data(), 2 * n);
    ExpectClose(g1, g2, 1e-5, "gelu grad");  // FastTanh: ~1e-7 absolute
    VecF s1(n), s2(n);
    ops::SwigluForward(par_, s1.data(), x.data(), 1, n);
    ops::ref::SwigluForward<float>(s2.data(), x.data(), 1, n);
    ExpectClose(s1, s2, 1e-6, "swiglu");
    ops::SwigluBackward(par_, g1.data(), x.data(), d.data(), 1, n);
    ops::ref::SwigluBackward<float>(g2.data(), x.data(), d.data(), 1, n);
    ExpectClose(g1, g2, 1e-6, "swiglu grad");
    ops::ResidualForward(par_, s1.data(), x.data(), d.data(), n);
    ops::ref::ResidualForward<float>(s2.data(), x.data(), d.data(), n);
    EXPECT_EQ(s1, s2);
  }
}

TEST_P(OpsFast, EncoderMatchesReferenceBitwise) {
  const int64_t B = 3, T = 7, C = 17, V = 5;
  std::vector<int32_t> tok(B * T);
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = static_cast<int32_t>((i * 7) % V);
  const VecF wte = Random<float>(V * C, 52), wpe = Random<float>(T * C, 53);
  const VecF d = Random<float>(B * T * C, 54);
  VecF o1(B * T * C), o2 = o1;
  ops::EncoderForward(par_, o1.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  ops::ref::EncoderForward<float>(o2.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
  EXPECT_EQ(o1, o2);
  VecF a1(V * C, 1), p1(T * C, 1), a2 = a1, p2 = p1;
  ops::EncoderBackward(par_, a1.data(), p1.data(), d.data(), tok.data(), B, T, C);
  ops::ref::EncoderBackward<float>(a2.data(), p2.data(), d.data(), tok.data(), B, T, C);
  EXPECT_EQ(a1, a2);
  EXPECT_EQ(p1, p2);
}

TEST_P(OpsFast, ClassifierMatchesReferenceAcrossBlocks) {
  // V large enough that ClassifierBlockRows < N: several row blocks.
  const int64_t C = 19, V = 70001, Vp = 70016, N = 300;
  ASSERT_LT(ops::ClassifierBlockRows(N, V), N);
  const VecF x = Random<float>(N * C, 60), w = Random<float>(Vp * C, 61, 0.3);
  std::vector<int32_t> tg(N);
  for (int64_t i = 0; i < N; ++i) tg[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 7919) % V);
  VecF dx1(N * C, 0), dw1(Vp * C, 0), dx2 = dx1, dw2 = dw1, logits(N * V);
  const double l1 = ops::ClassifierForwardBackward(par_, dx1.data(), dw1.data(), x.data(), w.data(),
                                                   tg.data(), N, C, V, 0.5f);
  const double l2 = ops::ref::ClassifierForwardBackward<float>(
      dx2.data(), dw2.data(), logits.data(), x.data(), w.data(), tg.data(), N, C, V, 0.5f);
  EXPECT_NEAR(l1, l2, 1e-6 * std::abs(l2));
  const double l3 = ops::ClassifierForwardBackward(par_, nullptr, nullptr, x.data(), w.data(),
                                                   tg.data(), N, C, V, 0.5f);
  EXPECT_EQ(l1, l3);
  ExpectClose(dx1, dx2, 1e-5, "classifier dx");
  ExpectClose(dw1, dw2, 1e-5, "classifier dw");
  for (int64_t i = V * C; i < Vp * C; ++i) ASSERT_EQ(dw1[i], 0.0f) << i;
}

INSTANTIATE_TEST_SUITE_P(Threads, OpsFast, testing::Values(1, 2, 3),
                         [](const auto& p) { return "t" + std::to_string(p.param); });

}  // namespace
}  // namespace ucp::offload
