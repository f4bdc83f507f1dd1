// The models: parameter names/shapes/order against the rule sets, the double-precision reference
// graph against finite differences, the fp32 model against that reference and against finite
// differences of its own Forward, determinism, accumulation and the padded vocabulary rows.
#include "offload/model/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "offload/model/model_graph.h"
#include "offload/model/model_ref.h"
#include "ucp/patterns/model.h"

namespace ucp::offload {
namespace {

const std::string kPatterns = std::string(UCP_TEST_SOURCE_DIR) + "/patterns";

ModelConfig Tiny(Family family, bool tied) {
  ModelConfig c;
  c.family = family;
  c.vocab = 29;
  c.padded_vocab = 32;
  c.hidden = 12;
  c.layers = 2;
  if (family == Family::kGpt) {
    c.heads = c.kv_heads = 3;
    c.head_dim = 5;  // != hidden / heads
  } else {
    c.heads = 4;
    c.kv_heads = 2;
    c.head_dim = 6;
  }
  c.ffn_hidden = 10;
  c.max_positions = 9;
  c.tied_embeddings = tied;
  return c;
}

struct Case {
  Family family;
  bool tied;
};
std::string CaseName(const Case& c) {
  return std::string(c.family == Family::kGpt ? "Gpt" : "Llama") + (c.tied ? "Tied" : "Untied");
}
std::string Name(const testing::TestParamInfo<Case>& info) { return CaseName(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << CaseName(c); }

// Weights like an initialised model (norm weights near 1), deterministic.
std::vector<double> InitWeights(const std::vector<ParamInfo>& params, int64_t total,
                                uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 0.3);
  std::vector<double> w(total);
  for (const ParamInfo& p : params) {
    const bool norm_w = p.name.find("layernorm.weight") != std::string::npos;
    for (int64_t i = 0; i < p.numel; ++i) w[p.offset + i] = (norm_w ? 1.0 : 0.0) + nd(rng);
  }
  return w;
}

struct Tokens {
  std::vector<int32_t> in, tg;
  Batch batch;
};
Tokens MakeTokens(const ModelConfig& c, int64_t B, int64_t T, uint64_t seed) {
  Tokens t;
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < B * T; ++i) {
    t.in.push_back(static_cast<int32_t>(rng() % c.vocab));
    t.tg.push_back(i % 5 == 2 ? -1 : static_cast<int32_t>(rng() % c.vocab));  // some masked
  }
  t.batch = Batch{t.in, t.tg, B, T};
  return t;
}

TEST(ModelParams, MatchTheRuleSetsWithPaddedVocab) {
  for (const char* preset :
       {"gpt-tiny", "gpt2-small", "gpt2-medium", "llama-tiny", "llama-tiny-tied"}) {
    SCOPED_TRACE(preset);
    auto spec = patterns::LoadModel(kPatterns, preset);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    auto cfg = ModelConfig::FromSpec(*spec);
    ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
    EXPECT_EQ(cfg->padded_vocab % spec->hyper.at("make_vocab_size_divisible_by"), 0);
    EXPECT_GE(cfg->padded_vocab, cfg->vocab);
    EXPECT_LT(cfg->padded_vocab - cfg->vocab, spec->hyper.at("make_vocab_size_divisible_by"));
    auto expected = spec->Parameters();
    ASSERT_TRUE(expected.ok());
    auto got = ModelParams(*cfg);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), expected->size());
    int64_t offset = 0;
    for (size_t i = 0; i < got->size(); ++i) {
      const ParamInfo& p = (*got)[i];
      const patterns::ParamSpec& e = (*expected)[i];
      EXPECT_EQ(p.name, e.name);
      std::vector<int64_t> shape(e.shape.begin(), e.shape.end());
      if (p.name == "embedding.word_embeddings.weight" || p.name == "output_layer.weight") {
        shape[0] = cfg->padded_vocab;
      }
      EXPECT_EQ(p.shape, shape) << p.name;
      EXPECT_EQ(p.offset, offset) << p.name;
      offset += p.numel;
    }
  }
  EXPECT_EQ(ModelConfig::FromSpec(*patterns::LoadModel(kPatterns, "gpt2-small"))->padded_vocab,
            50304);
}

TEST(ModelConfig, FromSpecRejectsBadHyperParameters) {
  auto spec = *patterns::LoadModel(kPatterns, "llama-tiny");
  auto bad = spec;
  bad.family = "mixtral";
  auto r = ModelConfig::FromSpec(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("family"), std::string::npos);
  bad = spec;
  bad.hyper["kv_heads"] = 3;
  r = ModelConfig::FromSpec(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("kv_heads"), std::string::npos);
  bad = spec;
  bad.hyper.erase("ffn_hidden");
  r = ModelConfig::FromSpec(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("ffn_hidden"), std::string::npos);
}

class ModelGrad : public testing::TestWithParam<Case> {};

// The double reference graph against central differences of its own forward, every parameter
// tensor probed at a few elements.
TEST_P(ModelGrad, ReferenceMatchesFiniteDifferences) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  auto params = *ModelParams(c);
  const int64_t total = params.back().offset + params.back().numel;
  std::vector<double> w = InitWeights(params, total, 7);
  Tokens t = MakeTokens(c, 2, 7, 8);
  std::vector<double> g(total, 0.0);
  ASSERT_TRUE(RefForwardBackward(c, w, g, t.batch, 1.0).ok());
  std::mt19937_64 rng(9);
  for (const ParamInfo& p : params) {
    for (int k = 0; k < 3; ++k) {
      const int64_t i = p.offset + static_cast<int64_t>(rng() % p.numel);
      const double saved = w[i], h = 1e-5;
      w[i] = saved + h;
      const double up = *RefForwardBackward(c, w, {}, t.batch, 1.0);
      w[i] = saved - h;
      const double down = *RefForwardBackward(c, w, {}, t.batch, 1.0);
      w[i] = saved;
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(g[i], fd, 1e-6 * (1 + std::abs(fd))) << p.name << " element " << i - p.offset;
    }
  }
}

// The fp32 model against the double reference (all gradients), and against fp32 central
// differences of Model::Forward at a handful of elements.
TEST_P(ModelGrad, FastMatchesReferenceAndFiniteDifferences) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  auto model = Model::Create(c, 3, 9, 2);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const int64_t total = model->num_params();
  const std::vector<double> wd = InitWeights(model->params(), total, 11);
  std::vector<float> w(wd.begin(), wd.end());
  const std::vector<double> wr(w.begin(), w.end());  // the same values, exactly
  Tokens t = MakeTokens(c, 3, 9, 12);
  const float scale = 0.25f;
  std::vector<double> gr(total, 0.0);
  const double loss_ref = *RefForwardBackward(c, wr, gr, t.batch, scale);
  std::vector<float> g(total, 0.0f);
  auto loss = model->ForwardBackward(w, g, t.batch, scale);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_NEAR(*loss, loss_ref, 1e-5 * std::abs(loss_ref));
  EXPECT_EQ(*model->Forward(w, t.batch), *loss);
  for (const ParamInfo& p : model->params()) {
    double gmax = 0, err = 0;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      gmax = std::max(gmax, std::abs(gr[i]));
      err = std::max(err, std::abs(gr[i] - g[i]));
    }
    EXPECT_LE(err, 1e-4 * std::max(gmax, 1e-2)) << p.name << " max |g| " << gmax;
  }
  // fp32 finite differences: loose, but a wrong sign, factor or missing term fails it.
  std::mt19937_64 rng(13);
  int checked = 0;
  for (const ParamInfo& p : model->params()) {
    const int64_t i = p.offset + static_cast<int64_t>(rng() % p.numel);
    if (std::abs(g[i]) < 1e-2) continue;  // too small to resolve in fp32
    const float saved = w[i], h = 1e-2f;
    w[i] = saved + h;
    const double up = *model->Forward(w, t.batch);
    w[i] = saved - h;
    const double down = *model->Forward(w, t.batch);
    w[i] = saved;
    const double fd = scale * (up - down) / (2.0 * h);
    EXPECT_NEAR(g[i], fd, 0.03 * std::abs(fd) + 2e-3) << p.name;
    ++checked;
  }
  EXPECT_GE(checked, 4);
}

TEST_P(ModelGrad, DeterministicAccumulatingAndPaddedRowsStayZero) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  auto model = *Model::Create(c, 2, 8, 2);
  const int64_t total = model.num_params();
  const std::vector<double> wd = InitWeights(model.params(), total, 21);
  const std::vector<float> w(wd.begin(), wd.end());
  Tokens t = MakeTokens(c, 2, 8, 22);
  std::vector<float> g1(total, 0.0f), g2(total, 0.0f);
  const double l1 = *model.ForwardBackward(w, g1, t.batch, 1.0f);
  const double l2 = *model.ForwardBackward(w, g2, t.batch, 1.0f);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(g1, g2);  // bitwise
  // += : a second call on the same buffer doubles it (up to the rounding of the additions).
  ASSERT_TRUE(model.ForwardBackward(w, g2, t.batch, 1.0f).ok());
  for (int64_t i = 0; i < total; ++i) {
    ASSERT_NEAR(g2[i], 2 * g1[i], 1e-5 * (1 + std::abs(g1[i]))) << i;
  }
  // Padded vocabulary rows: exactly zero gradient (starting from zero).
  for (const ParamInfo& p : model.params()) {
    if (p.name != "embedding.word_embeddings.weight" && p.name != "output_layer.weight") continue;
    for (int64_t i = c.vocab * c.hidden; i < p.numel; ++i) {
      ASSERT_EQ(g1[p.offset + i], 0.0f) << p.name << " element " << i;
    }
  }
  // A thread count changes the partition, not the math.
  auto model1 = *Model::Create(c, 2, 8, 1);
  std::vector<float> g3(total, 0.0f);
  EXPECT_NEAR(*model1.ForwardBackward(w, g3, t.batch, 1.0f), l1, 1e-5 * std::abs(l1));
  for (int64_t i = 0; i < total; ++i) ASSERT_NEAR(g3[i], g1[i], 1e-4 * (1 + std::abs(g1[i])));
}

// The backward hook: the groups tile the parameters, are reported in backward order (head,
// last layer .. first, embeddings), each group's gradient is final when reported, and the hooked
// call gives the plain call's bits.
TEST_P(ModelGrad, BackwardHookReportsFinalGroupsInOrderAndChangesNoBits) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  auto model = *Model::Create(c, 2, 8, 2);
  const int64_t total = model.num_params();
  const std::vector<double> wd = InitWeights(model.params(), total, 41);
  const std::vector<float> w(wd.begin(), wd.end());
  Tokens t = MakeTokens(c, 2, 8, 42);
  const auto& groups = model.grad_groups();
  ASSERT_EQ(groups.size(), static_cast<size_t>(c.layers + 2));
  EXPECT_EQ(groups.front().name, "head");
  EXPECT_EQ(groups[1].name, "layers." + std::to_string(c.layers - 1));
  EXPECT_EQ(groups.back().name, "embedding");
  std::vector<int> covered(model.params().size(), 0);
  for (const GradGroup& g : groups) {
    for (int64_t i = g.first_param; i < g.end_param; ++i) covered[i] += 1;
  }
  for (int v : covered) EXPECT_EQ(v, 1);

  std::vector<float> plain(total, 0.0f), hooked(total, 0.0f);
  const double l1 = *model.ForwardBackward(w, plain, t.batch, 1.0f);
  std::vector<int> order;
  std::vector<std::vector<float>> seen;  // the whole gradient when each group was reported
  bool began = false;
  BackwardHook hook;
  hook.on_backward_begin = [&] { began = order.empty(); };
  hook.on_group_done = [&](int k) {
    order.push_back(k);
    seen.push_back(hooked);
  };
  const double l2 = *model.ForwardBackward(w, hooked, t.batch, 1.0f, hook);
  EXPECT_TRUE(began);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(plain, hooked);  // bitwise
  ASSERT_EQ(order.size(), groups.size());
  for (size_t k = 0; k < order.size(); ++k) {
    EXPECT_EQ(order[k], static_cast<int>(k));
    const auto& ps = model.params();
    for (int64_t i = groups[k].first_param; i < groups[k].end_param; ++i) {
      const int64_t b = ps[i].offset, e = b + ps[i].numel;
      for (int64_t j = b; j < e; ++j) {
        ASSERT_EQ(seen[k][j], hooked[j]) << groups[k].name << " " << ps[i].name << " " << j;
      }
    }
  }
}

// Windows that hand the graph each group in a buffer of its own (copied in at Acquire, the
// gradients copied back at Release), recording the calls: what a streaming device does, with
// every group at a new address, so a read through a flat offset would show.
class CopyWindows final : public WeightWindows {
 public:
  CopyWindows(const Model& m, std::span<const float> w, std::span<float> g) : w_(w), g_(g) {
    for (const GradGroup& gr : m.grad_groups()) {
      const ParamInfo& first = m.params()[static_cast<size_t>(gr.first_param)];
      const ParamInfo& last = m.params()[static_cast<size_t>(gr.end_param - 1)];
      ranges_.emplace_back(first.offset, last.offset + last.numel);
    }
    held_w_.resize(ranges_.size());
    held_g_.resize(ranges_.size());
  }
  Result<Slot> Acquire(int group, bool grads) override {
    calls.push_back("+" + std::to_string(group) + (grads ? "g" : ""));
    if (group == fail_at) return DataLossError("injected");
    const auto [b, e] = ranges_[static_cast<size_t>(group)];
    auto& hw = held_w_[static_cast<size_t>(group)];
    auto& hg = held_g_[static_cast<size_t>(group)];
    if (!hw.empty()) return FailedPreconditionError("acquired twice");
    hw.assign(w_.begin() + b, w_.begin() + e);
    if (grads) hg.assign(g_.begin() + b, g_.begin() + e);
    int layers = 0;
    for (size_t k = 1; k + 1 < held_w_.size(); ++k) layers += held_w_[k].empty() ? 0 : 1;
    max_layers = std::max(max_layers, layers);
    return Slot{hw.data(), grads ? hg.data() : nullptr};
  }
  Status Release(int group, bool grads) override {
    calls.push_back("-" + std::to_string(group) + (grads ? "g" : ""));
    const auto [b, e] = ranges_[static_cast<size_t>(group)];
    auto& hg = held_g_[static_cast<size_t>(group)];
    if (grads) std::copy(hg.begin(), hg.end(), g_.begin() + b);
    held_w_[static_cast<size_t>(group)].clear();
    hg.clear();
    return Status::Ok();
  }
  std::vector<std::string> calls;
  int max_layers = 0;  // layers held at once
  int fail_at = -1;    // Acquire of this group fails

 private:
  std::span<const float> w_;
  std::span<float> g_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;
  std::vector<std::vector<float>> held_w_, held_g_;
};

// Streamed weights (WeightWindows): the same loss and gradient bits as the flat buffers, each
// group acquired in the documented order (one layer at a time; with tied embeddings the
// embeddings stay acquired from the classifier to the encoder's backward), the gradients added
// into what the windows hand over (a second micro-batch accumulates), and a failing Acquire
// stops the graph with its error.
TEST_P(ModelGrad, WindowsGiveTheFlatBitsInTheGraphsOrder) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  auto model = *Model::Create(c, 2, 8, 2);
  const int64_t total = model.num_params();
  const std::vector<double> wd = InitWeights(model.params(), total, 51);
  const std::vector<float> w(wd.begin(), wd.end());
  Tokens t = MakeTokens(c, 2, 8, 52);
  Tokens t2 = MakeTokens(c, 2, 8, 53);
  std::vector<float> flat(total, 0.0f), win(total, 0.0f);
  const double l1 = *model.ForwardBackward(w, flat, t.batch, 0.5f);
  const double l1b = *model.ForwardBackward(w, flat, t2.batch, 0.5f);
  CopyWindows cw(model, w, win);
  const double l2 = *model.ForwardBackward(cw, t.batch, 0.5f, nullptr);
  const double l2b = *model.ForwardBackward(cw, t2.batch, 0.5f, nullptr);
  EXPECT_EQ(l1, l2);
  EXPECT_EQ(l1b, l2b);
  EXPECT_EQ(flat, win);  // bitwise, accumulated over two calls
  EXPECT_EQ(cw.max_layers, 1);
  const std::string emb = std::to_string(c.layers + 1);
  std::vector<std::string> want = {"+" + emb, "-" + emb};
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string k = std::to_string(c.layers - l);
    want.push_back("+" + k);
    want.push_back("-" + k);
  }
  want.push_back("+0g");
  if (c.tied_embeddings) want.push_back("+" + emb + "g");
  want.push_back("-0g");
  for (int64_t l = c.layers - 1; l >= 0; --l) {
    const std::string k = std::to_string(c.layers - l);
    want.push_back("+" + k + "g");
    want.push_back("-" + k + "g");
  }
  if (!c.tied_embeddings) want.push_back("+" + emb + "g");
  want.push_back("-" + emb + "g");
  ASSERT_EQ(cw.calls.size(), 2 * want.size());
  EXPECT_EQ(std::vector<std::string>(cw.calls.begin(), cw.calls.begin() + want.size()), want);

  // Forward alone: the flat loss, no gradient touched.
  cw.calls.clear();
  EXPECT_EQ(*model.Forward(cw, t.batch), *model.Forward(w, t.batch));
  EXPECT_EQ(cw.calls.back(), c.tied_embeddings ? "-" + emb : "-0");
  for (const std::string& call : cw.calls) EXPECT_EQ(call.find('g'), std::string::npos) << call;

  // A window that fails: the graph stops with its error, naming the group.
  cw.fail_at = 1;
  const Result<double> r = model.ForwardBackward(cw, t.batch, 0.5f, nullptr);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("grad group 1"), std::string::npos) << r.status().message();
}

// Recomputed layers (Recompute): the first r layers share one layer's activations besides their
// outputs, as ActivationBytes says, and give the bits of the model that keeps them all: the
// loss, the gradients over two accumulated micro-batches (the second shorter than the first),
// forward alone, and through streamed weights with the same Acquire / Release calls. Three
// layers, recomputing 2 (one rerun, one layer keeping its own) and all 3 (two reruns; the last
// layer's activations are still there from forward).
TEST_P(ModelGrad, RecomputedLayersGiveTheKeptBits) {
  ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  c.layers = 3;
  auto kept = *Model::Create(c, 2, 8, 2);
  EXPECT_EQ(kept.recompute(), Recompute::None());
  EXPECT_EQ(kept.activation_bytes(), *ActivationBytes(c, 2, 8, 2, 1, Recompute::None()));
  // Per row of a layer's slot: ln1, resid_mid, ln2, the norms' 4 statistics, qkv, atty, lse,
  // fch, fch_act.
  const int64_t F1 = c.family == Family::kGpt ? c.ffn_hidden : 2 * c.ffn_hidden;
  const int64_t slot_bytes = 2 * 8 * static_cast<int64_t>(sizeof(float)) *
                             (3 * c.hidden + 4 + (c.heads + 2 * c.kv_heads) * c.head_dim +
                              c.heads * c.head_dim + c.heads + F1 + c.ffn_hidden);
  const int64_t total = kept.num_params();
  const std::vector<double> wd = InitWeights(kept.params(), total, 61);
  const std::vector<float> w(wd.begin(), wd.end());
  Tokens t = MakeTokens(c, 2, 8, 62);
  Tokens t2 = MakeTokens(c, 1, 5, 63);
  std::vector<float> gk(total, 0.0f);
  const double lk = *kept.ForwardBackward(w, gk, t.batch, 0.5f);
  const double lk2 = *kept.ForwardBackward(w, gk, t2.batch, 0.5f);
  std::vector<float> wk(total, 0.0f);
  CopyWindows ck(kept, w, wk);
  ASSERT_TRUE(kept.ForwardBackward(ck, t.batch, 0.5f, nullptr).ok());

  for (const Recompute r : {Recompute{2}, Recompute::All()}) {
    SCOPED_TRACE("recomputing " + std::to_string(r.Of(c.layers)) + " layers");
    auto rc = *Model::Create(c, 2, 8, 2, nullptr, r);
    EXPECT_EQ(rc.recompute(), r);
    EXPECT_EQ(rc.activation_bytes(), *ActivationBytes(c, 2, 8, 2, 1, r));
    // r layers in one slot: r - 1 slots fewer.
    EXPECT_EQ(kept.activation_bytes() - rc.activation_bytes(), (r.Of(c.layers) - 1) * slot_bytes);
    std::vector<float> gr(total, 0.0f);
    EXPECT_EQ(lk, *rc.ForwardBackward(w, gr, t.batch, 0.5f));
    EXPECT_EQ(lk2, *rc.ForwardBackward(w, gr, t2.batch, 0.5f));
    EXPECT_EQ(gk, gr);  // bitwise
    EXPECT_EQ(*kept.Forward(w, t.batch), *rc.Forward(w, t.batch));
    std::vector<float> wr(total, 0.0f);
    CopyWindows cr(rc, w, wr);
    ASSERT_TRUE(rc.ForwardBackward(cr, t.batch, 0.5f, nullptr).ok());
    EXPECT_EQ(wk, wr);
    EXPECT_EQ(ck.calls, cr.calls);
    EXPECT_EQ(cr.max_layers, 1);
  }
  EXPECT_EQ(Model::Create(c, 2, 8, 2, nullptr, Recompute{-1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ActivationBytes(c, 2, 8, 2, 1, Recompute{-1}).status().code(),
            StatusCode::kInvalidArgument);
}

// A policy that keeps the weights as the CUDA model's packed fp32 copy beside bf16 GEMMs does
// (model_graph.h OwnsWeights), over the reference ops: the norms, biases and embeddings from a
// copy packed to Fp32ReadRanges, the matrices from a buffer holding nothing else (NaN elsewhere).
struct PackedRefOps : graph::RefOps<double> {
  graph::PackedIndex index;
  const double* packed = nullptr;
  const double* matrices = nullptr;
  std::vector<int64_t> misses;  // offsets read through Fp32Weight that the copy does not hold

  struct GemmW {
    const double* p;
  };
  GemmW GemmWeight(int64_t off, const double* windowed) {
    if (windowed != nullptr) misses.push_back(off);  // nothing here is streamed
    return {matrices + off};
  }
  const double* Fp32Weight(int64_t off) {
    const int64_t at = index.At(off);
    if (at < 0) {
      misses.push_back(off);
      return matrices + off;
    }
    return packed + at;
  }
  void MatmulForward(double* out, const double* inp, GemmW w, const double* bias, int64_t N,
                     int64_t C, int64_t OC) {
    ops::ref::MatmulForward<double>(out, inp, w.p, bias, N, C, OC);
  }
  void MatmulBackward(double* dinp, double* dw, double* dbias, const double* dout,
                      const double* inp, GemmW w, int64_t N, int64_t C, int64_t OC) {
    ops::ref::MatmulBackward<double>(dinp, dw, dbias, dout, inp, w.p, N, C, OC);
  }
  double Classifier(double* dx, double* dw, const double* x, GemmW w, const int32_t* tg,
                    int64_t N, int64_t C, int64_t V, double grad_scale) {
    return RefOps::Classifier(dx, dw, x, w.p, tg, N, C, V, grad_scale);
  }
};

// Fp32ReadRanges holds exactly the parameters that are no GEMM's matrix (by name), and a graph
// that reads the packed copy for them and a matrices-only buffer for its GEMMs gives the flat
// reference's loss and gradients bit for bit: every read goes where the packed CUDA device has
// the bytes (a matrix read through the packed copy, or a norm through the GEMMs' buffer, shows).
TEST_P(ModelGrad, PackedFp32WeightsGiveTheFlatBits) {
  const ModelConfig c = Tiny(GetParam().family, GetParam().tied);
  const graph::Layout lay = *graph::BuildLayout(c);
  const auto ranges = *Fp32ReadRanges(c);
  auto gemm_matrix = [&](const ParamInfo& p) {
    for (const char* m : {"query_key_value.weight", "attention.dense.weight",
                          "dense_h_to_4h.weight", "dense_4h_to_h.weight", "output_layer.weight"}) {
      if (p.name.find(m) != std::string::npos) return true;
    }
    return false;
  };
  graph::PackedIndex index(ranges);
  int64_t kept = 0;
  for (const ParamInfo& p : lay.params) {
    const bool held = index.At(p.offset) >= 0 && index.At(p.offset + p.numel - 1) >= 0;
    EXPECT_EQ(held, !gemm_matrix(p)) << p.name;
    if (held) kept += p.numel;
  }
  EXPECT_EQ(index.elements(), kept);
  for (size_t i = 1; i < ranges.size(); ++i) {
    EXPECT_LT(ranges[i - 1].second, ranges[i].first) << "ranges ascend and are merged";
  }

  const std::vector<double> w = InitWeights(lay.params, lay.total, 61);
  std::vector<double> packed(static_cast<size_t>(index.elements()));
  std::vector<double> matrices(w.size(), std::nan(""));
  for (const ParamInfo& p : lay.params) {
    // The GEMMs read the matrices and, tied, the embeddings as the head.
    const bool head = c.tied_embeddings && p.offset == lay.wte;
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      if (gemm_matrix(p) || head) matrices[i] = w[i];
      if (index.At(i) >= 0) packed[index.At(i)] = w[i];
    }
  }
  const Tokens t = MakeTokens(c, 2, 7, 62);
  std::vector<double> g_flat(w.size(), 0.0), g_packed(w.size(), 0.0);
  const double loss_flat = *RefForwardBackward(c, w, g_flat, t.batch, 0.5);

  PackedRefOps ops;
  ops.index = index;
  ops.packed = packed.data();
  ops.matrices = matrices.data();
  graph::Acts<double> acts;
  acts.Allocate(c, 2 * 7, 7, (c.heads + 2 * c.kv_heads) * c.head_dim);
  const Result<double> loss = graph::RunGraph<double>(
      ops, c, lay, acts, static_cast<const double*>(nullptr), g_packed.data(),
      t.batch.inputs.data(), t.batch.targets.data(), 2, 7, 0, 0.5,
      static_cast<graph::NoSequenceParallel<double>*>(nullptr));
  ASSERT_TRUE(loss.ok()) << loss.status().message();
  EXPECT_TRUE(ops.misses.empty()) << "first miss at " << ops.misses.front();
  EXPECT_EQ(*loss, loss_flat);
  EXPECT_EQ(g_packed, g_flat);
}

INSTANTIATE_TEST_SUITE_P(Families, ModelGrad,
                         testing::Values(Case{Family::kGpt, true}, Case{Family::kGpt, false},
                                         Case{Family::kLlama, true}, Case{Family::kLlama, false}),
                         Name);

TEST(Model, RejectsBadInputs) {
  const ModelConfig c = Tiny(Family::kGpt, true);
  auto model = *Model::Create(c, 2, 8, 1);
  std::vector<float> w(model.num_params(), 0.01f), g(model.num_params());
  Tokens t = MakeTokens(c, 2, 8, 30);
  t.in[5] = static_cast<int32_t>(c.vocab);  // a padded row is not a token
  auto r = model.Forward(w, t.batch);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("input token 29"), std::string::npos);
  t.in[5] = 0;
  t.tg[3] = static_cast<int32_t>(c.vocab);
  r = model.ForwardBackward(w, g, t.batch, 1.0f);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("target token"), std::string::npos);
  t.tg[3] = 0;
  Tokens big = MakeTokens(c, 3, 8, 31);
  r = model.Forward(w, big.batch);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("batch=3"), std::string::npos);
  r = model.Forward(std::span<const float>(w).subspan(1), t.batch);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("weights hold"), std::string::npos);
  auto m = Model::Create(c, 1, 10, 1);  // > max_positions
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("max_positions"), std::string::npos);
}

}  // namespace
}  // namespace ucp::offload
